"""The words the controller and the engines it starts share: the kinds of foreign engine the agent fronts, and the
placeholders and names that travel in their command lines.

Here, in the shared vocabulary, so that the controller builds those command lines without importing the engines'
modules (and torch with them)."""

from __future__ import annotations

from dataclasses import dataclass

PORT_PLACEHOLDER = "{port}"  # the agent's engine command: replaced by the port the agent picks
SOCKET_RANK = "{rank}"  # --socket's placeholder for the rank, with --tp-size > 1
LOAD_FORMAT = "hotweights"  # vLLM's and SGLang's --load-format that maps the daemon's arena (standby.*_loader)
VLLM_FORMAT = "vllm"  # cache serve --format: vLLM's own loader fills the arena (cache.vllm_format)
SGLANG_FORMAT = "sglang"  # cache serve --format: SGLang's own loader fills the arena (cache.sglang_format)
SERVED_NAME_FLAG = "--served-model-name"  # vLLM's and SGLang's: the model's name in the API (default: its path)


@dataclass(frozen=True)
class EngineKind:
    """How the agent talks to one kind of engine."""

    name: str
    server_module: str  # python -m this serves the OpenAI API
    model_flag: str  # the server's flag naming the checkpoint
    tokenizer_flag: str  # its flag naming another tokenizer than the checkpoint's
    health: str  # the engine's own health endpoint
    running_metric: str  # its Prometheus gauge of requests being generated
    chat_token_ids: bool  # streams a chat's token ids itself (else the agent bridges it: standby.chatbridge)


KINDS = {
    "vllm": EngineKind(
        "vllm",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "--tokenizer",
        "/health",
        "vllm:num_requests_running",
        chat_token_ids=True,
    ),
    "sglang": EngineKind(
        "sglang",
        "sglang.launch_server",
        "--model-path",
        "--tokenizer-path",
        "/health",
        "sglang:num_running_reqs",
        chat_token_ids=False,
    ),
}
