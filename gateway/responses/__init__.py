"""OpenAI Responses (`/v1/responses`) with the conversation state kept by the gateway.

`view` parses a Responses body for routing; `history` expands `previous_response_id` into the
whole input and makes the record stored after an answer; `store` (SQLite, on a path or in
memory) and `redis_store` (shared by replicas and `--workers`) keep the records; `endpoint`
serves POST through the inference path; `stored` answers GET, DELETE and cancel.
"""
