"""Validated configuration: model, MoE, parallel layout and engine.

Each section is a small dataclass checked in ``__post_init__``; a bad value raises
``ConfigError`` with one line naming the key, the value and what was expected. YAML configs,
the presets and mappings are read by ``moe_infer.config_files``; the Hugging Face
``config.json`` reader lives in ``moe_infer.hf`` and builds the same objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kernels.options import KernelOptions


class ConfigError(ValueError):
    """A configuration key has a value the system cannot run with."""


def _fail(key: str, value, expected: str):
    raise ConfigError(f"{key}={value!r}: expected {expected}")


def _check_positive(section: str, obj, *names: str):
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            _fail(f"{section}.{name}", value, "a positive number")


def _check_choice(section: str, obj, name: str, choices: tuple[str, ...]):
    value = getattr(obj, name)
    if value not in choices:
        _fail(f"{section}.{name}", value, "one of " + ", ".join(choices))


ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass
class RopeScaling:
    """Scaled rotary positions, as transformers' ``rope_parameters`` name them (the keys a
    type does not use stay unset): ``linear`` (positions divided by ``factor``), ``dynamic``
    (NTK: the base grows once a forward's positions pass ``model.max_position``), ``yarn``,
    ``llama3`` and ``longrope`` (``short_factor`` / ``long_factor`` per frequency, the long
    ones once a forward's positions pass ``original_max_position_embeddings``)."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None  # yarn / longrope: cos and sin scaled by it
    beta_fast: float | None = None  # yarn (default 32)
    beta_slow: float | None = None  # yarn (default 1)
    mscale: float | None = None  # yarn (DeepSeek): attention_factor from mscale / mscale_all_dim
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: the correction range rounded out to whole dimensions
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    short_factor: tuple[float, ...] = ()  # longrope, one per frequency (half the rotary dimensions)
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        s = "model.rope_scaling"
        _check_choice(s, self, "rope_type", ROPE_TYPES)
        need = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("original_max_position_embeddings",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("original_max_position_embeddings",)}[self.rope_type]
        for name in need:
            if getattr(self, name) is None:
                _fail(f"{s}.{name}", None, f"a value for rope_type {self.rope_type}")
        for name in ("factor", "original_max_position_embeddings", "attention_factor", "low_freq_factor",
                     "high_freq_factor"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                _fail(f"{s}.{name}", getattr(self, name), "a positive number")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            _fail(f"{s}.high_freq_factor", self.high_freq_factor, f"more than low_freq_factor={self.low_freq_factor}")
        self.short_factor, self.long_factor = tuple(self.short_factor), tuple(self.long_factor)


@dataclass
class ModelConfig:
    """The dense backbone. ``num_kv_heads``/``head_dim`` of None mean MHA / hidden // heads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden: int  # width of the dense MLP (dense layers only)
    num_kv_heads: int | None = None
    head_dim: int | None = None
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    # swiglu (gated SiLU) | gelu (plain, GPT style) | swiglu_oai (GPT-OSS's experts: the
    # gate clamped above at 7, up to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1))
    activation: str = "swiglu"
    positions: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None  # None: the whole head; GLM-4.5: the first half of each head
    max_position: int = 4096
    tied_embeddings: bool = False
    parallel_block: bool = False  # x + attn(norm(x)) + ffn(norm(x)), one norm (GPT-J / PaLM)
    # none | head (Qwen3: per head) | full (OLMoE: over all heads) | l2 (Llama 4: per head,
    # no weights, rotary layers only)
    qk_norm: str = "none"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # The layers that attend within ``sliding_window``; empty: every layer (GPT-OSS: every
    # other one)
    sliding_layers: tuple[int, ...] = ()
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax
    # Llama 4: the layers that attend within chunks of ``attention_chunk`` positions (a query
    # sees the earlier keys of its own chunk), the layers without rotary positions (NoPE),
    # whose queries scale with log1p(floor((position + 1) / floor)) * scale + 1 where
    # ``nope_temperature`` = (floor, scale) is set, and rotary over interleaved pairs of each
    # head (dimensions 2i, 2i + 1) instead of its two halves.
    attention_chunk: int | None = None
    chunked_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    nope_temperature: tuple[float, float] | None = None
    rope_interleaved: bool = False
    # DeepSeek-V2 / V3 multi-head latent attention (``dense/mla.py``): keys and values from
    # a latent of kv_lora_rank a token, queries through a q_lora_rank bottleneck where set;
    # head_dim is a query / key head (rotary_dim of it rotary), v_head_dim a value head.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    v_head_dim: int | None = None
    clip_qkv: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        s = "model"
        _check_positive(s, self, "vocab_size", "hidden_size", "num_layers", "num_heads",
                        "ffn_hidden", "norm_eps", "rope_theta", "max_position")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                _fail(f"{s}.num_heads", self.num_heads,
                      f"a divisor of model.hidden_size={self.hidden_size} (or set model.head_dim)")
            self.head_dim = self.hidden_size // self.num_heads
        _check_positive(s, self, "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            _fail(f"{s}.num_kv_heads", self.num_kv_heads,
                  f"a divisor of model.num_heads={self.num_heads}")
        if self.positions == "rope" and self.head_dim % 2:
            _fail(f"{s}.head_dim", self.head_dim, "an even number for rotary positions")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            _fail(f"{s}.rotary_dim", self.rotary_dim, f"an even number in (0, model.head_dim={self.head_dim}]")
        r = self.rope_scaling
        if isinstance(r, dict):
            r = self.rope_scaling = section_from_dict(RopeScaling, r, f"{s}.rope_scaling")
        if r is not None and r.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(r, name)) != self.rotary_width // 2:
                    _fail(f"{s}.rope_scaling.{name}", list(getattr(r, name)),
                          f"{self.rotary_width // 2} numbers (half the rotary dimensions)")
        _check_choice(s, self, "norm", ("rmsnorm", "layernorm"))
        _check_choice(s, self, "activation", ("swiglu", "gelu", "swiglu_oai"))
        _check_choice(s, self, "positions", ("rope", "learned"))
        _check_choice(s, self, "qk_norm", ("none", "head", "full", "l2"))
        if self.sliding_window is not None and self.sliding_window <= 0:
            _fail(f"{s}.sliding_window", self.sliding_window, "a positive number or null")
        for name, needs in (("sliding_layers", "sliding_window"), ("chunked_layers", "attention_chunk"),
                            ("nope_layers", None)):
            layers = tuple(getattr(self, name))
            setattr(self, name, layers)
            if layers and needs is not None and getattr(self, needs) is None:
                _fail(f"{s}.{name}", list(layers), f"empty when model.{needs} is null")
            if any(not 0 <= i < self.num_layers for i in layers):
                _fail(f"{s}.{name}", list(layers), f"layer indices in [0, {self.num_layers})")
        if self.sliding_layers and self.chunked_layers:
            _fail(f"{s}.chunked_layers", list(self.chunked_layers), "empty where model.sliding_layers is set")
        if self.kv_lora_rank is not None:
            _check_positive(s, self, "kv_lora_rank", "v_head_dim")
            if self.rotary_dim is None or self.rotary_dim >= self.head_dim:
                _fail(f"{s}.rotary_dim", self.rotary_dim, f"the rotary part of model.head_dim={self.head_dim} "
                      "(qk_rope_head_dim), less than it, with model.kv_lora_rank")
        if self.attention_chunk is not None and self.attention_chunk <= 0:
            _fail(f"{s}.attention_chunk", self.attention_chunk, "a positive number or null")
        if self.nope_temperature is not None:
            self.nope_temperature = tuple(self.nope_temperature)
            if len(self.nope_temperature) != 2 or self.nope_temperature[0] <= 0:
                _fail(f"{s}.nope_temperature", list(self.nope_temperature), "[floor > 0, scale] or null")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            _fail(f"{s}.clip_qkv", self.clip_qkv, "a positive number or null")
        self.eos_token_ids = tuple(self.eos_token_ids)
        for tok in (*self.eos_token_ids, self.bos_token_id):
            if tok is not None and not 0 <= tok < self.vocab_size:
                _fail(f"{s}.eos_token_ids/bos_token_id", tok,
                      f"token ids in [0, {self.vocab_size})")

    @property
    def kv_widths(self) -> tuple[int, int]:
        """(key, value) widths of one KV head in the cache: the latent and the rotary key
        in one "key" under latent attention, no value."""
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + self.rotary_width, 0
        return self.head_dim, self.head_dim

    @property
    def gated(self) -> bool:
        """Whether the FFN's up projection holds gate and up rows (SwiGLU, GPT-OSS's too)."""
        return self.activation in ("swiglu", "swiglu_oai")

    @property
    def rotary_width(self) -> int:
        """The dimensions of each head that rotary positions turn (the first ones)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim


@dataclass
class MoEConfig:
    """The sparse FFN. Layer i is MoE iff i >= first_dense, (i + 1) % every == 0 and
    i is not listed in dense_layers (the Qwen2-MoE / DeepSpeed-MoE conventions)."""

    num_experts: int
    top_k: int
    expert_hidden: int  # F: width of one expert
    every: int = 1  # 1: every layer, 2: every other layer (1, 3, 5, ...)
    first_dense: int = 0  # DeepSeek style: the first k layers stay dense
    dense_layers: tuple[int, ...] = ()
    shared_experts: int = 0
    shared_expert_hidden: int = 0  # width of each shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(x @ g) scales the shared output
    score: str = "softmax"  # softmax | sigmoid
    renormalize: bool = True  # divide the top-k weights by their sum
    # DeepSeek-V3 / GLM-4.5 routing: a learned bias on the scores that picks the experts (not
    # their weights), experts in n_group groups of which the topk_group best stay eligible,
    # the weights scaled by routed_scaling_factor (``kernels.grouped_topk``).
    score_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    group_score: str = "top2"  # a group's score: its two best choices' sum (V3) | max: its best (V2)
    router_bias: bool = False  # GPT-OSS: the router's logits have a learned bias
    expert_bias: bool = False  # GPT-OSS: each expert's two projections have biases
    weighted_input: bool = False  # Llama 4: the routing weight scales the expert's input, not its output
    capacity_factor: float | None = None  # None: dropless

    def __post_init__(self):
        s = "moe"
        _check_positive(s, self, "num_experts", "top_k", "expert_hidden", "every")
        _check_choice(s, self, "group_score", ("top2", "max"))
        if self.top_k > self.num_experts:
            _fail(f"{s}.top_k", self.top_k, f"at most moe.num_experts={self.num_experts}")
        if self.first_dense < 0:
            _fail(f"{s}.first_dense", self.first_dense, "a number >= 0")
        if self.shared_experts < 0:
            _fail(f"{s}.shared_experts", self.shared_experts, "a number >= 0")
        if self.shared_experts and self.shared_expert_hidden <= 0:
            _fail(f"{s}.shared_expert_hidden", self.shared_expert_hidden,
                  "a positive width when moe.shared_experts > 0")
        if self.shared_expert_gate and not self.shared_experts:
            _fail(f"{s}.shared_expert_gate", True, "false when moe.shared_experts is 0")
        _check_choice(s, self, "score", ("softmax", "sigmoid"))
        _check_positive(s, self, "n_group", "topk_group", "routed_scaling_factor")
        if self.num_experts % self.n_group:
            _fail(f"{s}.n_group", self.n_group, f"a divisor of moe.num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            _fail(f"{s}.topk_group", self.topk_group, f"at most moe.n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            _fail(f"{s}.top_k", self.top_k, f"at most the experts of moe.topk_group={self.topk_group} groups")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            _fail(f"{s}.capacity_factor", self.capacity_factor, "a positive number or null")
        self.dense_layers = tuple(self.dense_layers)

    @property
    def grouped(self) -> bool:
        """Routing through ``kernels.grouped_topk`` (a score bias, groups or a scale)."""
        return self.score_bias or self.n_group > 1 or self.routed_scaling_factor != 1.0

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense and (i + 1) % self.every == 0 and i not in self.dense_layers


@dataclass
class ParallelConfig:
    """Degrees of parallelism; the expert dimension reuses the dense part's ranks."""

    tp: int = 1
    ep: int = 1
    # Ranks that split each expert's width. None: the tensor-parallel ranks that expert
    # parallelism leaves (tp / ep where ep divides tp, else 1), so that tensor parallelism
    # splits the experts as it splits the dense layers (as vLLM's does); 1 replicates them.
    expert_slicing: int | None = None
    pp: int = 1
    dp: int = 1
    pcc: bool = True  # parallelism-coordinated all-to-all; False: naive all-to-all baseline
    timeout_s: float = 300.0  # a collective waiting longer than this fails the job
    # A rank's MoE layer over at most this many tokens sends each peer a fixed-capacity
    # buffer of tokens x top_k x expert_slicing rows, its unused rows marked on the device:
    # the sizes are known without waiting for the device's counts. The captured decode
    # steps (GPUs) always exchange so, up to their largest batch; this extends it to the
    # eager steps. Larger batches exchange their counts first and send exact sizes.
    a2a_fixed_tokens: int = 0
    # The tensor-parallel all-reduce on GPUs. "auto": tensors of at most 2 MiB (decode
    # sizes) are summed by one kernel that reads each peer's copy from its memory (torch's
    # symmetric-memory one-shot all-reduce, where the GPUs reach each other's memory), NCCL
    # otherwise; "nccl": NCCL always.
    all_reduce: str = "auto"
    # Data-parallel attention: where the experts spread over the data-parallel replicas
    # (tp not a multiple of ep * expert_slicing), generate() still splits the prompts;
    # each runs attention for its own sequences only and the replicas share the experts
    # through the all-to-all, stepping together (as vLLM and SGLang run MoE models).
    # False: every replica runs every prompt there.
    dp_attention: bool = False
    # Pipeline stages' inference schedule (generate(), pp > 1): the batch's rows split into
    # this many micro-batches while generating, each one's next token entering the first
    # stage as soon as the last stage has drawn it, so no stage waits (None: pp; 1 drains
    # the pipeline every token); and into this many while processing the prompts, where
    # more and smaller micro-batches shorten the fill and drain (None: 4 * pp).
    micro_batches: int | None = None
    prompt_micro_batches: int | None = None
    # How the tensor-parallel ranks split the KV cache: "heads", each its KV heads (one
    # replicated over tp / num_kv_heads ranks where there are fewer); "tokens", every rank
    # all heads of the tokens in every tp-th block, the queries gathered and each rank's
    # partial attention combined (``dense.kv_shard``): no copy of the cache on two ranks (a
    # latent cache, one "head", is whole on every rank split by heads).
    kv_shard: str = "heads"

    def __post_init__(self):
        _check_positive("parallel", self, "tp", "ep", "pp", "dp", "timeout_s")
        _check_choice("parallel", self, "kv_shard", ("heads", "tokens"))
        if self.kv_shard == "tokens" and self.tp == 1:
            _fail("parallel.kv_shard", "tokens", "heads with tp = 1 (tokens splits the cache over the tp ranks)")
        if self.micro_batches is None:
            self.micro_batches = self.pp
        if self.prompt_micro_batches is None:
            self.prompt_micro_batches = 4 * self.pp
        _check_positive("parallel", self, "micro_batches", "prompt_micro_batches")
        if self.expert_slicing is None:
            self.expert_slicing = self.tp // self.ep if self.tp % self.ep == 0 else 1
        _check_positive("parallel", self, "expert_slicing")
        _check_choice("parallel", self, "all_reduce", ("auto", "nccl"))
        if not isinstance(self.dp_attention, bool):
            _fail("parallel.dp_attention", self.dp_attention, "true or false")
        if self.dp_attention and not (self.dp > 1 and self.tp % (self.ep * self.expert_slicing)):
            _fail("parallel.dp_attention", True,
                  f"false for this layout: it needs data-parallel replicas (dp > 1, got {self.dp}) that "
                  f"share experts (tp not a multiple of ep * expert_slicing; got ep={self.ep}, expert_slicing="
                  f"{self.expert_slicing}, tp={self.tp}); other replicas already split the prompts")
        v = self.a2a_fixed_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail("parallel.a2a_fixed_tokens", v, "an integer >= 0")
        expert_ranks = self.ep * self.expert_slicing
        if self.world_size % expert_ranks:
            _fail("parallel.ep", self.ep,
                  f"ep * expert_slicing ({expert_ranks}) dividing the world size "
                  f"tp * pp * dp = {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class EngineConfig:
    max_seq_len: int | None = None  # None: the model's max_position
    max_batch_size: int = 16
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0  # seeds random weights for configs without a checkpoint
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (GPUs, one or several ranks)
    # At load: "int8": weight-only int8 experts and linear layers; "mxfp4": the routed experts
    # 4-bit (MXFP4, as GPT-OSS releases them), the rest in the model dtype.
    quantize: str | None = None
    # Most prompt tokens one prefill forward takes (rows x prompt width): a larger batch
    # prefills in groups of whole rows, a longer prompt in pieces, so the activations of a
    # prefill stay bounded (a 47B MoE's expert activations for 64 prompts of 2048 tokens
    # in one forward would take over 20 GB beside its weights).
    prefill_tokens: int = 16384
    # Prefills of fresh prompts of at most this many tokens (rows x padded width) replay
    # CUDA graphs, one per (rows, width) bucket, where decode steps do: an eager forward
    # costs the host about the same launches whatever its size, several times a small
    # prefill's device time, and as much as the device's own up to several thousand tokens.
    # 0: every prefill runs eagerly.
    prefill_graph_tokens: int = 8192
    # Decode-path kernels launch with programmatic dependent launch on GPUs that have it
    # (compute capability 9.0 or later): each may start while the one before finishes and
    # waits for it before reading. false: plain launches, the baseline of an A/B run.
    pdl: bool = True
    # A static decode step runs its attention (QKV epilogue, cache append, attention) in one
    # launch where it fits. false: the epilogue launch, then SDPA.
    fused_decode_attention: bool = True
    # Shared experts run inside the routed experts' fused MoE call, as more experts every
    # token takes, where the layer allows it (``MoELayer.fold_shared``). false: the shared
    # MLP runs by itself and its output is added.
    fold_shared_experts: bool = True
    # Under expert parallelism, a layer's shared experts (where tensor parallelism does not
    # split them) run on a second stream of the device while the routed experts and their
    # collectives run. false: after them.
    overlap_shared_experts: bool = True
    # A prefill replayed from a CUDA graph (``prefill_graph_tokens``) runs its attention on
    # cuDNN's SDPA kernels where they take the shapes: one execution plan a bucket, built at
    # capture. false: the flash kernels eager prefills run.
    cudnn_prefill_graphs: bool = True
    # Models larger than the device: at most this many GB of weights stay on it (None: all).
    # Everything but the routed experts first, then the experts hit most; the others live
    # in host memory and run as ``offload`` says: "cpu" (computed by the CPU; decode runs
    # eagerly), "stream" (read in place by the device's kernels at decode sizes, so decode
    # runs in CUDA graphs; copied to the device for larger calls), "auto" (as stream at
    # decode sizes; larger calls by whichever way this machine's measured figures make faster).
    gpu_memory_gb: float | None = None
    offload: str = "auto"
    # offload: "layers" (ZeRO-Inference, for throughput): every block's weights in host
    # memory, copied to the device as it runs, this many blocks ahead; gpu_memory_gb unset.
    prefetch_layers: int = 1
    # Where the weights kept in host memory (gpu_memory_gb's cold experts, or every block
    # with offload: layers) are memory-mapped from files written at load instead of held in
    # RAM, for hosts whose memory cannot hold them: the operating system reads them from
    # disk as calls need them. None: in RAM (pinned on a GPU host).
    offload_dir: str | None = None
    # The KV cache in host memory (pinned on a GPU), each layer's copied in as it runs, for
    # batches whose cache the device cannot hold (``dense.kv_offload``); steps run eagerly.
    # "all": every layer's; "alternate": the layers of the GPU's parity (GPUs that share a
    # PCIe link never copy at once; the other layers stay on the device); null: none.
    kv_offload: str | None = None
    # The cost model's hardware profile for ``parallel: auto``: a shipped name (moe_infer/
    # hardware/) or a YAML from ``moe-infer calibrate``; None: the shipped profile of this GPU.
    hardware: str | None = None

    def __post_init__(self):
        s = "engine"
        if self.hardware is not None and (not isinstance(self.hardware, str) or not self.hardware):
            _fail(f"{s}.hardware", self.hardware, "a hardware profile name or YAML path")
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, str) or not self.offload_dir:
                _fail(f"{s}.offload_dir", self.offload_dir, "a directory path, or null")
            if self.gpu_memory_gb is None and self.offload != "layers":
                _fail(f"{s}.offload_dir", self.offload_dir, "null unless gpu_memory_gb or offload: layers keeps "
                      "weights in host memory")
        if self.gpu_memory_gb is not None and (isinstance(self.gpu_memory_gb, bool)
                                               or not isinstance(self.gpu_memory_gb, (int, float))
                                               or self.gpu_memory_gb <= 0):
            _fail(f"{s}.gpu_memory_gb", self.gpu_memory_gb, "a positive number of GB, or null")
        _check_choice(s, self, "offload", ("auto", "cpu", "stream", "layers"))
        if self.offload == "layers" and self.gpu_memory_gb is not None:
            _fail(f"{s}.gpu_memory_gb", self.gpu_memory_gb, "null with offload: layers (every block streams "
                  "from host memory; the device holds prefetch_layers + 1 of them)")
        v = self.prefetch_layers
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail(f"{s}.prefetch_layers", v, "an integer >= 0")
        if self.quantize is not None:
            _check_choice(s, self, "quantize", ("int8", "mxfp4"))
        if self.kv_offload is not None:
            _check_choice(s, self, "kv_offload", ("all", "alternate"))
        for name in ("cuda_graphs", "pdl", "fused_decode_attention", "fold_shared_experts",
                     "overlap_shared_experts", "cudnn_prefill_graphs"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{s}.{name}", getattr(self, name), "true or false")
        if self.max_seq_len is not None:
            _check_positive(s, self, "max_seq_len")
        _check_positive(s, self, "max_batch_size", "prefill_tokens")
        v = self.prefill_graph_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail(f"{s}.prefill_graph_tokens", v, "an integer >= 0")
        _check_choice(s, self, "dtype", ("auto", "float32", "float16", "bfloat16"))
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            _fail(f"{s}.device", self.device, "auto, cpu, cuda or cuda:N")

    def kernel_options(self) -> KernelOptions:
        """The options the model hands to every layer that launches kernels."""
        return KernelOptions(pdl=self.pdl, fused_decode_attention=self.fused_decode_attention,
                             fold_shared_experts=self.fold_shared_experts,
                             overlap_shared_experts=self.overlap_shared_experts,
                             cudnn_prefill_graphs=self.cudnn_prefill_graphs)


@dataclass
class Config:
    """Everything needed to build and run one model."""

    model: ModelConfig
    moe: MoEConfig | None = None  # None: a dense model
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    name: str = "custom"
    checkpoint: str | None = None  # a Hugging Face checkpoint directory for the weights
    # ``parallel: auto`` in YAML: the loader picks the layout of the job's ranks by the cost
    # model (``moe_infer.costmodel.choose_layout``) in place of ``parallel``.
    parallel_auto: bool = False

    def __post_init__(self):
        m, e, p = self.model, self.moe, self.parallel
        if m.activation == "swiglu_oai" and (e is None or e.shared_experts or e.every > 1 or e.first_dense
                                             or e.dense_layers):
            _fail("model.activation", m.activation, "swiglu or gelu where a layer has a dense MLP or shared "
                  "experts (swiglu_oai is GPT-OSS's, for routed experts only)")
        if p.kv_shard == "tokens" and self.engine.kv_offload is not None:
            _fail("parallel.kv_shard", "tokens", "heads with engine.kv_offload (the two together are not built)")
        if self.engine.quantize == "mxfp4" and (e is None or m.hidden_size % 32 or e.expert_hidden % 32):
            _fail("engine.quantize", "mxfp4", "int8 or null: MXFP4 takes a MoE model whose hidden size and expert "
                  "width are multiples of 32 (its groups)")
        if m.num_heads % p.tp:
            _fail("parallel.tp", p.tp, f"a divisor of model.num_heads={m.num_heads}")
        if m.num_kv_heads % p.tp and p.tp % m.num_kv_heads:
            _fail("parallel.tp", p.tp, f"a divisor or multiple of model.num_kv_heads={m.num_kv_heads}")
        if p.pp > m.num_layers:
            _fail("parallel.pp", p.pp, f"at most model.num_layers={m.num_layers} (a block or more a stage)")
        if e is not None:
            if e.num_experts % p.ep:
                _fail("parallel.ep", p.ep, f"a divisor of moe.num_experts={e.num_experts}")
            if e.capacity_factor is not None and p.ep * p.expert_slicing > 1:
                _fail("moe.capacity_factor", e.capacity_factor, "null (expert parallelism runs dropless)")
            if p.pcc and p.tp > 1 and p.ep * p.expert_slicing > 1 and (p.ep * p.expert_slicing) % p.tp:
                _fail("parallel.pcc", True, f"false for this layout (PCC needs ep * expert_slicing a "
                      f"multiple of tp={p.tp}; got ep={p.ep}, expert_slicing={p.expert_slicing})")
            if e.expert_hidden % p.expert_slicing:
                _fail("parallel.expert_slicing", p.expert_slicing,
                      f"a divisor of moe.expert_hidden={e.expert_hidden}")
            for i in e.dense_layers:
                if not 0 <= i < m.num_layers:
                    _fail("moe.dense_layers", i, f"layer indices in [0, {m.num_layers})")
            if not any(e.is_moe_layer(i) for i in range(m.num_layers)):
                _fail("moe", "no MoE layer", "at least one layer selected by every/first_dense")
        # (dynamic NTK scaling is for running past the trained context: its max_position is that)
        dynamic = m.rope_scaling is not None and m.rope_scaling.rope_type == "dynamic"
        if self.engine.max_seq_len is not None and self.engine.max_seq_len > m.max_position and not dynamic:
            _fail("engine.max_seq_len", self.engine.max_seq_len,
                  f"at most model.max_position={m.max_position}")

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len or self.model.max_position

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    def folds_shared(self, parallel: "ParallelConfig | None" = None) -> bool:
        """Whether the loader folds the shared experts into the routed experts' call
        (``moe_infer.moe_layer.MoELayer.fold_shared``) under ``parallel`` (default: this
        config's): the option on; every expert whole on each rank and a shared MLP that
        tensor parallelism does not split; no shared gate, capacity or expert biases; the
        shared width a multiple of the routed one; the experts neither offloaded nor made
        MXFP4 (which would take the shared experts to 4 bits with them)."""
        e, engine, p = self.moe, self.engine, parallel or self.parallel
        return (e is not None and e.shared_experts > 0 and engine.fold_shared_experts and p.tp == 1 and p.ep == 1
                and p.expert_slicing == 1 and not e.shared_expert_gate and e.capacity_factor is None
                and not e.expert_bias and e.shared_experts * e.shared_expert_hidden % e.expert_hidden == 0
                and engine.gpu_memory_gb is None and engine.quantize != "mxfp4")

    def folded_experts(self, parallel: "ParallelConfig | None" = None) -> int:
        """The experts of the routed width a layer's shared experts become where the loader
        folds them under ``parallel`` (``folds_shared``); 0 where it does not."""
        e = self.moe
        return e.shared_experts * e.shared_expert_hidden // e.expert_hidden if self.folds_shared(parallel) else 0
