"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through PD.

The body goes to both legs as the client sent it, with the gateway's bootstrap fields (SGLang
0.5.23's `AnthropicMessagesRequest` takes `PDRoutingFields` and converts to chat with
`pd_routing_kwargs()`); the decode's answer is relayed in Anthropic's shape. What differs from
the OpenAI routes lives here: the request view (`view`), the error envelope (`errors`), the
stream's end and leading failure (`stream`), and the endpoints (`endpoint`).
"""
