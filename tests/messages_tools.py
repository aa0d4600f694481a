"""A tool and a conversation that used it, in the Anthropic Messages shape: the same
requests for the simulated and the real-SGLang tests of /v1/messages."""

TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
TOOL_HISTORY = [
    {"role": "user", "content": "what is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C and sunny"},
        {"type": "text", "text": "and tomorrow?"}]}]
