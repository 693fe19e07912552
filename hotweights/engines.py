"""The words the controller and the engines it starts share: the engines a group may run, the kinds of foreign
engine the agent fronts, and the placeholders and names that travel in their command lines.

Here, in the shared vocabulary, so that the controller builds those command lines without importing the engines'
modules (and torch with them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

PORT_PLACEHOLDER = "{port}"  # the agent's engine command: replaced by the port the agent picks
SOCKET_RANK = "{rank}"  # --socket's placeholder for the rank, with --tp-size > 1
LOAD_FORMAT = "hotweights"  # vLLM's and SGLang's --load-format that maps the daemon's arena (standby.*_loader)
VLLM_FORMAT = "vllm"  # cache serve --format: vLLM's own loader fills the arena (cache.vllm_format)
SGLANG_FORMAT = "sglang"  # cache serve --format: SGLang's own loader fills the arena (cache.sglang_format)
SERVED_NAME_FLAG = "--served-model-name"  # vLLM's and SGLang's: the model's name in the API (default: its path)


class Engine(StrEnum):
    """The engine a group runs (``cluster.toml``'s ``engine``): ours, or vLLM or SGLang behind the agent."""

    REFERENCE = "reference"
    VLLM = "vllm"
    SGLANG = "sglang"

    def __repr__(self) -> str:  # as cluster.toml writes it, in messages ("found 'vllm'")
        return repr(self.value)


@dataclass(frozen=True)
class EngineKind:
    """How the agent talks to one kind of engine."""

    name: Engine
    server_module: str  # python -m this serves the OpenAI API
    model_flag: str  # the server's flag naming the checkpoint
    tokenizer_flag: str  # its flag naming another tokenizer than the checkpoint's
    health: str  # the engine's own health endpoint
    running_metric: str  # its Prometheus gauge of requests being generated
    step_metric: str  # its Prometheus counter that every prefill and decode step moves
    core_title: str  # the process title of its engine core, the process that generates (stall-primary stops it)
    chat_token_ids: bool  # streams a chat's token ids itself (else the agent bridges it: standby.chatbridge)
    # The environment variables naming its on-disk compile caches, each with its directory's name under the
    # stack's compile cache (``Layout.compile_cache``), so that every later server reuses what one compiled.
    compile_caches: tuple[tuple[str, str], ...]
    # The environment its servers need on a CPU device beside their thread count (``OMP_NUM_THREADS``), so that the
    # servers of one host share its cores rather than pile onto the same ones.
    cpu_env: tuple[tuple[str, str], ...] = ()


KINDS = {
    Engine.VLLM: EngineKind(
        Engine.VLLM,
        "vllm.entrypoints.openai.api_server",
        "--model",
        "--tokenizer",
        "/health",
        "vllm:num_requests_running",
        "vllm:generation_tokens_total",
        "VLLM::EngineCore",
        chat_token_ids=True,
        # its torch.compile artifacts (Inductor's and Triton's under them), then Inductor's for what it compiles
        # outside them
        compile_caches=(("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")),
        # On a CPU, vLLM binds its worker's OpenMP threads to the allowed cores less one it reserves, the same ones
        # in every server of the host (on 2 cores: all of them compute on core 0, a serving primary with every
        # server starting beside it); unbound, the kernel spreads them.
        cpu_env=(("VLLM_CPU_OMP_THREADS_BIND", "nobind"),),
    ),
    Engine.SGLANG: EngineKind(
        Engine.SGLANG,
        "hotweights.standby.sglang_server",  # sglang.launch_server, its subprocesses forked on a CPU
        "--model-path",
        "--tokenizer-path",
        "/health",
        "sglang:num_running_reqs",
        "sglang:realtime_tokens_total",  # (its generation_tokens_total moves only every 50 tokens of a request)
        "sglang::scheduler",
        chat_token_ids=False,
        # SGLang points Triton's, Inductor's, CUDA's and FlashInfer's caches below it (those not set already)
        compile_caches=(("SGLANG_CACHE_DIR", "sglang"),),
    ),
}
