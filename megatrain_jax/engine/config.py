"""``EngineConfig``: how the engine runs a step. Its own module, so that planning memory or parsing a
config file does not import the engine."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatrain_jax.engine.precision import Precision, check_precision, mode_of

# ``resident_layers = "auto"``, ``kept_layers = "auto"``: picked by the plan for the machine (``plan.resolve``):
# the fastest layout that fits where the GPU's rates are known (``plan.step_time``), else the most resident
# blocks that fit and none keeping products.
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How a step is run.

    - ``micro_batches`` bounds transient activation memory only: weights cross PCIe twice per step
      whatever it is.
    - ``prefetch_depth``: layers fetched ahead of the one computing. Two by default: on a GPU a copy into new
      device memory starts only once the compute queued before it has run (XLA's allocator is synchronized with
      the compute stream), so with one ahead each block's copy waits for the block before it and the forward
      waits for the copy; one block more on the GPU hides it.
    - ``clip_norm``: exact global-norm clipping (the norm of the whole gradient); None turns it off.
    - ``accumulate_steps`` batches make one optimizer step.
    - ``stream_dtype`` is the dtype of the weights sent to the device (None: the model's compute dtype);
      a 16-bit one keeps a copy in host memory, written by the optimizer.
    - A step whose loss or gradient norm is not finite is skipped (state unchanged); more than
      ``max_nonfinite_steps`` in a row stop training with ``NonFiniteError``.
    - ``host_kernel=False`` runs ``megatrain_jax.adamw`` through JAX instead of the fused C++ kernel.
    - ``resident_layers`` (the first blocks) and ``resident_io`` keep parts on the GPU with their
      optimizer state (``megatrain_jax.engine.update.resident``): faster when GPU memory allows, about 18 bytes per
      parameter. ``resident_layers="auto"``: ``megatrain-jax train`` and ``plan`` pick the count
      (``plan.resolve``): where the GPU's rates are known, the fastest layout that fits by the step-time model
      (``plan.step_time``), else as many blocks as fit; an ``Engine`` takes a number.
    - ``grads_on_gpu``: this many host-updated parts (the blocks that are not GPU-resident in forward order,
      then the io part) keep their float32 gradient on the GPU while the step waits for the global norm,
      instead of in pinned host memory: 4 bytes per parameter less host RAM, as much more GPU memory from
      the part's backward until its update copies the gradient home early in the next step (one part at a
      time, so host memory holds one such gradient). ``megatrain-jax train`` picks it when host RAM is short
      (``plan.lean_engine``).
    - ``master_dtype``, ``moment_dtype`` (and ``stream_dtype``) choose a precision mode: full precision
      (float32, the default), capacity mode (``master_dtype="bfloat16"``, opt-in) or capacity mode with
      8-bit moments (``moment_dtype="q8"``, opt-in). Each mode's record in ``megatrain_jax.engine.precision``
      says what it keeps in which dtype, what crosses PCIe, what it needs and excludes and which settings
      come with it (``EngineConfig.precision``); quality: docs/capacity.md.
    - ``host_grad_dtype="bfloat16"`` (where the mode allows it; opt-in): the gradients that come home to host
      memory for the update are rounded to bfloat16 on the GPU first (half the pinned memory and PCIe traffic
      of float32). The global norm, and so the clipping, is computed from the rounded gradients, exactly over
      what was sent; it differs from the float32 gradient's norm by the rounding (relative error under 2^-9
      per element). With ``accumulate_steps`` > 1 each sub-step's sum is rounded again. Gradients that wait on
      the GPU (``grads_on_gpu``) stay float32; those updated on the GPU follow ``device_grad_dtype``.
    - ``device_grad_dtype="bfloat16"`` (opt-in): the gradients of the parts updated on the GPU (GPU-resident
      parts, ``gpu_updated_layers``, ``gpu_updated_io``), which wait there for the global norm or for the next
      forward's visit, are kept in bfloat16 once the optimizer step's sum is complete: half their GPU memory
      (2 bytes a parameter of every resident part at the backward's end), which the plan gives to more resident
      blocks. The norm is the rounded gradients', as for ``host_grad_dtype``. With ``accumulate_steps`` > 1 the
      sub-steps' sum stays float32 until the last, then is rounded (no GPU memory saved). Set both to bfloat16 to
      round every gradient once before its update (``grads_on_gpu``'s stay float32; with ``accumulate_steps`` > 1
      those sent home are rounded at each sub-step). On the CPU, with one micro-batch on one device, a block's
      gradient is a bfloat16 cotangent, which the rounding leaves as it is; on a GPU it is not (see
      ``host_grad_dtype``).
    - ``disk_parts``: the Adam moments of this many blocks (the last ones that are not GPU-resident) live in
      files under ``disk_dir`` on local disk (``megatrain_jax.engine.update.disk_tier``), read ahead of each block's
      update and written behind it: their moments' bytes (``Precision.moment_bytes``) less host RAM,
      beyond the four blocks' worth in flight during the updates (so it pays from five blocks on), at the
      price of reading and writing that much per step. Needs ``megatrain_jax.adamw`` in the fused kernel,
      and one process; one engine per folder (``Engine.close()`` deletes the files).
    - ``offload_activations``: the inputs of this many blocks (the first ones; never the last
      ``prefetch_depth``, whose backward follows at once) wait in pinned host memory from their forward to
      their backward, copied out behind the forward and back one block ahead of the backward: long
      sequences whose layer-boundary activations would not fit on the GPU. Host RAM holds rows x seq_len x
      hidden x 2 bytes per offloaded block. ``megatrain-jax train`` picks it when the GPU is short
      (``plan.lean_engine``).
    - ``keep_residuals`` (opt-in; for long sequences): what the model marks with
      ``megatrain_jax.contract.remat.keep_residuals`` (the Decoder: cuDNN flash attention's output and softmax
      statistics) is kept from each block's forward to its backward, which then does not recompute it:
      attention runs forward once per step instead of twice, the larger part of a long-context block's
      time. It costs about one more activation per block (rows x seq_len x heads x head_dim x 2 bytes, plus
      4 bytes per head and token of softmax statistics, times ``segments_per_row`` for packed rows),
      offloaded with the block's input under ``offload_activations``. ``megatrain-jax train`` turns it off,
      and says so, when nothing it would pick (offload, the lean host layout) fits with it
      (``plan.lean_engine``). Nothing is marked on XLA's attention (its residuals are T x T), so
      there it only changes which compiled programs run, not what they compute or keep.
    - ``kept_layers`` (opt-in; where GPU memory is left over): the last this many blocks keep every matrix
      product's output from their forward for their backward (``megatrain_jax.contract.remat.KEEP_PRODUCTS_POLICY``,
      and what ``keep_residuals`` keeps), so that their backward recomputes only elementwise work: about a
      quarter less compute for each such block, for about rows x seq_len x (q + 2 kv + hidden + 2 ffn) x 2
      bytes of GPU memory from its forward to its backward (``plan.gpu_ledger.products_bytes``). The same
      gradients: only what is recomputed changes. Never for offloaded blocks (``offload_activations``).
      ``kept_layers="auto"``: ``megatrain-jax train`` and ``plan`` pick the count with ``resident_layers``
      (``plan.resolve``): the pair the step-time model finds fastest among those that fit, where the GPU's rates
      are known; else none.
    - ``split_parts``: with the fused kernel and a bfloat16 stream copy (full precision), a host part's
      update may run in two passes: the first writes only the stream copy the next forward fetches, the
      second (queued after every part's first, last part first) the float32 masters and moments. The next
      forward then waits for the lighter pass, at the price of reading masters, moments and gradient twice
      (about 46 bytes per parameter against 30 in one pass); the second passes run beside the backward.
      Of the host-updated parts that can split, the last ``split_parts`` in update order (io, then the
      blocks) split (a larger count: all); the others update in one pass. Small batches, where the host
      update bounds the step, want few (the backward is too short to hide many second passes); long ones all. "auto": ``megatrain-jax train`` and ``plan``
      pick the count by the step-time model where the GPU's rates are known (``plan.resolve``); an
      ``Engine`` given "auto" splits them all. The same numbers either way: only when bytes are written
      changes. Parts whose gradient waits on the GPU (``grads_on_gpu``) or whose moments are on disk
      (``disk_parts``) never split and are not counted. A one-pass update writes the masters in the task the
      next forward waits for, so after a checkpoint save that forward may wait for the writer to pass the part
      (split parts write their masters in the second pass).
    - ``resident_copy``: whether each GPU-resident part keeps its compute-dtype copy (bfloat16 beside float32
      masters) on the GPU between its uses. Kept (true), the update writes it and each fetch takes it as is; not
      kept (false), each fetch casts the masters and the copy is dropped with the block's release: 2 bytes a
      parameter less of every resident part on the GPU (12 instead of 14 in full precision: more blocks fit),
      for a cast of 6 bytes a parameter of GPU memory traffic at each fetch (about 0.35 ms for a 3.5B model's
      block on an H200). The same numbers either way. Where the masters are what the GPU computes with (float32
      streaming, capacity and quantized modes) there is no copy and it does not apply. "auto": ``megatrain-jax
      train`` and ``plan`` pick it with the layout (where ``resident_layers`` or ``kept_layers`` is "auto" too) where
      the GPU's rates are known (``plan.layout.fastest``: the faster that fits); an ``Engine`` given "auto", or a
      plan without the GPU's rates, keeps the copies. Over several devices a resident part in use is gathered
      whole on each (its copy, or its masters where it computes with them), either way.
    - ``gpu_updated_layers`` (full precision): this many blocks after the GPU-resident ones stream like the
      others but update on the GPU (``megatrain_jax.engine.update.resident.DeviceUpdater.visit``). Their gradient
      waits on the GPU (float32) from the backward to the next step, at whose start their float32 masters and
      moments cross from pinned host memory (12 bytes a parameter, ``bring``); each block's forward fetch
      (``visit``) updates them on the GPU with the step's clip scale, keeps the new compute copy for that forward,
      and sends masters, moments and copy home (14 bytes a parameter): no host update and no gradient home, for
      26 bytes a parameter over PCIe instead of 4. Where
      the host update bounds the step (exact clipping makes every block's update wait for the whole backward)
      this moves work from the host's memory (about 46 bytes a parameter in two passes) to the PCIe lanes,
      which a streamed step leaves mostly idle. The same numbers as the host's update where the resident
      parts' equal it. A step's updates of these blocks complete at their next use: ``Engine.sync`` (every read
      of the state, a checkpoint, evaluation) completes them first. Not with capacity or quantized modes (the
      device update keeps float32 state) nor ``norm_first``. GPU memory: their float32 gradients from the
      backward to the next forward, and their masters and moments from the step's start to their visit.
      "auto": ``megatrain-jax train`` and ``plan`` pick the count with the layout (``plan.layout.fastest``, where
      the GPU's rates are known; else none); an ``Engine`` takes a number.
    - ``gpu_updated_io`` (full precision, the io part streamed: ``resident_io`` false): the io part (embeddings,
      final norm, head) streams but updates on the GPU, as ``gpu_updated_layers``' blocks do, with one difference:
      its masters and moments cross during the backward of the step that updates it (issued beside block 0's
      fetch for that backward), since its visit is the next forward's first op. With exact clipping the next
      forward otherwise waits at its start for the io part's host update (its first pass, ~30-47 ms at 3.5B on
      an H200 host), and every block after it for theirs. GPU memory: its float32 gradient from the backward to
      the next forward, and its masters and moments from the late backward to that visit. "auto": ``megatrain-jax
      train`` and ``plan`` make the whole pick (layout, then split count) with the io part on the host and on the
      GPU and take the faster of those that fit (``plan.layout``), where the GPU's rates are known; else false. An
      ``Engine`` takes a bool.
    - ``norm_first`` (opt-in; where host RAM is short): each step runs a forward and two backwards over its
      batch. The first backward only takes the global gradient norm (no gradient leaves the GPU); the second
      computes the same gradients again from the forward's block inputs (held on the GPU through both
      backwards, or in host memory for the ``offload_activations`` blocks), and each part updates as soon as
      its gradient is home, clipped by the first backward's norm. Host memory then holds no step's gradients,
      only those of the last ``UPDATES_AHEAD`` + 1 parts whose updates the host has not finished
      (``megatrain_jax.engine.schedule``), at the price of a second head and backward (and their weights' PCIe
      traffic). Exact: the same numbers as one pass where the backward is deterministic (on GPUs, XLA's
      ``--xla_gpu_deterministic_ops``; otherwise the second backward may differ from the first in the last
      bits, as two runs do). Needs ``accumulate_steps`` = 1
      (the norm of a sum over sub-steps needs that sum held) and ``grads_on_gpu`` = 0 (no gradient waits);
      updates never split (``split_parts`` does not apply).
    """

    micro_batches: int = 1
    prefetch_depth: int = 2
    clip_norm: float | None = 1.0
    accumulate_steps: int = 1
    stream_dtype: str | None = None
    max_nonfinite_steps: int = 10
    host_kernel: bool = True
    resident_layers: int | Literal["auto"] = 0
    resident_io: bool = False
    grads_on_gpu: int = 0
    master_dtype: str = "float32"
    moment_dtype: str | None = None
    host_grad_dtype: str = "float32"
    device_grad_dtype: str = "float32"
    disk_parts: int = 0
    disk_dir: str | None = None
    offload_activations: int = 0
    keep_residuals: bool = False
    kept_layers: int | Literal["auto"] = 0
    split_parts: int | Literal["auto"] = AUTO
    resident_copy: bool | Literal["auto"] = AUTO
    norm_first: bool = False
    gpu_updated_layers: int | Literal["auto"] = 0
    gpu_updated_io: bool | Literal["auto"] = False

    def __post_init__(self) -> None:
        for name in ("micro_batches", "prefetch_depth", "accumulate_steps", "max_nonfinite_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"EngineConfig.clip_norm must be positive or None, got {self.clip_norm!r}")
        if not isinstance(self.grads_on_gpu, int) or self.grads_on_gpu < 0:
            raise ValueError(f"EngineConfig.grads_on_gpu must be an integer >= 0, got {self.grads_on_gpu!r}")
        if self.resident_layers != AUTO and (not isinstance(self.resident_layers, int) or self.resident_layers < 0):
            raise ValueError(f"EngineConfig.resident_layers must be an integer >= 0 or 'auto', got "
                             f"{self.resident_layers!r}")
        if self.device_grad_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"EngineConfig.device_grad_dtype must be 'float32' or 'bfloat16', got "
                             f"{self.device_grad_dtype!r}")
        if self.stream_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"EngineConfig.stream_dtype must be None, 'float32' or 'bfloat16', "
                             f"got {self.stream_dtype!r}")
        if not isinstance(self.offload_activations, int) or self.offload_activations < 0:
            raise ValueError(f"EngineConfig.offload_activations must be an integer >= 0, got "
                             f"{self.offload_activations!r}")
        if not isinstance(self.keep_residuals, bool):
            raise ValueError(f"EngineConfig.keep_residuals must be true or false, got {self.keep_residuals!r}")
        if self.kept_layers != AUTO and (not isinstance(self.kept_layers, int) or isinstance(self.kept_layers, bool)
                                         or self.kept_layers < 0):
            raise ValueError(f"EngineConfig.kept_layers must be an integer >= 0 or 'auto', got {self.kept_layers!r}")
        if self.split_parts != AUTO and (not isinstance(self.split_parts, int) or isinstance(self.split_parts, bool)
                                         or self.split_parts < 0):
            raise ValueError(f"EngineConfig.split_parts must be an integer >= 0 or 'auto', got {self.split_parts!r}")
        if self.resident_copy != AUTO and not isinstance(self.resident_copy, bool):
            raise ValueError(f"EngineConfig.resident_copy must be true, false or 'auto', got {self.resident_copy!r}")
        if not isinstance(self.norm_first, bool):
            raise ValueError(f"EngineConfig.norm_first must be true or false, got {self.norm_first!r}")
        if self.norm_first and self.accumulate_steps > 1:
            raise ValueError(f"norm_first takes the global norm in a first pass over the step's batch; with "
                             f"accumulate_steps = {self.accumulate_steps} the norm is of a sum over sub-steps, "
                             f"which would have to be held: set accumulate_steps = 1 (raise micro_batches or the "
                             f"batch size instead), or norm_first = false")
        if self.norm_first and self.grads_on_gpu:
            raise ValueError(f"norm_first updates each part as its gradient comes home, so no gradient waits for the "
                             f"norm: set grads_on_gpu = 0 (it is {self.grads_on_gpu})")
        if self.gpu_updated_layers != AUTO and (not isinstance(self.gpu_updated_layers, int)
                                                or isinstance(self.gpu_updated_layers, bool) or self.gpu_updated_layers < 0):
            raise ValueError(f"EngineConfig.gpu_updated_layers must be an integer >= 0 or 'auto', got "
                             f"{self.gpu_updated_layers!r}")
        if self.gpu_updated_layers not in (0, AUTO) and self.norm_first:
            raise ValueError(f"gpu_updated_layers = {self.gpu_updated_layers} updates those blocks on the GPU at "
                             f"their next forward, and norm_first updates each part as its gradient comes home: "
                             f"set one of them (gpu_updated_layers = 0, or norm_first = false)")
        if self.gpu_updated_io != AUTO and not isinstance(self.gpu_updated_io, bool):
            raise ValueError(f"EngineConfig.gpu_updated_io must be true, false or 'auto', got {self.gpu_updated_io!r}")
        if self.gpu_updated_io is True and self.resident_io:
            raise ValueError("gpu_updated_io = true streams the io part and updates it on the GPU, and resident_io = "
                             "true keeps it there with its optimizer state (updated on the GPU already): set one of "
                             "them")
        if self.gpu_updated_io is True and self.norm_first:
            raise ValueError("gpu_updated_io = true updates the io part on the GPU at the next forward, and "
                             "norm_first updates each part as its gradient comes home: set one of them "
                             "(gpu_updated_io = false, or norm_first = false)")
        if not isinstance(self.disk_parts, int) or self.disk_parts < 0:
            raise ValueError(f"EngineConfig.disk_parts must be an integer >= 0, got {self.disk_parts!r}")
        check_precision(self)  # the precision settings make one mode, which can run the rest (the table's rules)
        if self.gpu_updated_layers not in (0, AUTO) and self.precision.stochastic:
            raise ValueError(f"gpu_updated_layers = {self.gpu_updated_layers}: the GPU's update keeps float32 "
                             f"masters and moments, and {self.precision.title} keeps them in 16 or fewer bits with "
                             f"stochastic rounding on the host; set gpu_updated_layers = 0 (or master_dtype = "
                             f"'float32' without moment_dtype)")
        if self.gpu_updated_io is True and self.precision.stochastic:
            raise ValueError(f"gpu_updated_io = true: the GPU's update keeps float32 masters and moments, and "
                             f"{self.precision.title} keeps them in 16 or fewer bits with stochastic rounding on the "
                             f"host; set gpu_updated_io = false (or master_dtype = 'float32' without moment_dtype)")
        if self.disk_parts and not self.disk_dir:
            raise ValueError(f"disk_parts={self.disk_parts} keeps moments in files: set disk_dir to a folder on "
                             f"local disk (NVMe), with room for {self.precision.moment_bytes} bytes per "
                             f"parameter of those blocks")
        if self.disk_parts and not self.host_kernel:
            raise ValueError("the disk tier (disk_parts) runs with the fused host kernel: leave host_kernel = true")

    def check_layers(self, n_blocks: int) -> None:
        """Raise ValueError saying what to set unless the per-block counts fit a model of ``n_blocks`` blocks:
        ``kept_layers`` (the last blocks) and ``offload_activations`` (the first ones) must not meet ("auto":
        the plan picks a count that fits)."""
        if self.kept_layers == AUTO:
            return
        if self.kept_layers > n_blocks:
            raise ValueError(f"engine.kept_layers = {self.kept_layers} is more than the model's {n_blocks} blocks: "
                             f"set at most {n_blocks}")
        from megatrain_jax.engine.schedule import offloaded_blocks  # (plain Python, as this module)
        offloaded = offloaded_blocks(n_blocks, self.prefetch_depth, self.offload_activations)
        if self.kept_layers and self.kept_layers + offloaded > n_blocks:
            raise ValueError(f"engine.kept_layers = {self.kept_layers} (the last blocks keep their matrix products "
                             f"on the GPU) and offload_activations = {self.offload_activations} (the inputs of the "
                             f"first {offloaded} blocks wait in host memory) overlap in a model of {n_blocks} "
                             f"blocks: set kept_layers <= {n_blocks - offloaded}")

    def splits(self, rows: int, devices: int = 1, pairs: bool = False) -> bool:
        """Whether a batch of ``rows`` rows splits into ``micro_batches`` equal micro-batches on each of
        ``devices`` GPUs (every micro-batch spreads its rows over the GPUs); with ``pairs`` (a pair objective:
        ``DPO``), each of them holding whole (chosen, rejected) pairs."""
        return rows >= 1 and devices >= 1 and rows % (self.micro_batches * devices * (2 if pairs else 1)) == 0

    def check_rows(self, rows: int, devices: int = 1, pairs: bool = False) -> None:
        """Raise ValueError saying what to use unless a batch of ``rows`` rows ``splits``. The one place of
        the rule: the engine, the memory plan and the command line's config check all call it."""
        if self.splits(rows, devices, pairs):
            return
        unit = self.micro_batches * max(devices, 1)
        per = f" on each of {devices} devices" if devices > 1 else ""
        if pairs and self.splits(rows, devices):
            raise ValueError(f"preference training takes rows in (chosen, rejected) pairs, and each of the "
                             f"{self.micro_batches} micro-batch(es){per} must hold whole pairs: {rows} rows give "
                             f"{rows // unit} per micro-batch; use a batch size divisible by {2 * unit}")
        raise ValueError(f"a batch of {rows} rows cannot be split into micro_batches = {self.micro_batches}"
                         f"{per}; use a batch size divisible by {unit * (2 if pairs else 1)}")

    @property
    def precision(self) -> Precision:
        """This config's precision mode (its record in ``engine.precision.MODES``), for a bfloat16 model where
        ``stream_dtype`` is unset: ``mode_of(config, model_dtype)`` tells full precision's two layouts apart."""
        return mode_of(self)

    @property
    def keeps_resident_copy(self) -> bool:
        """Whether GPU-resident parts keep their compute copy between uses (``resident_copy``; "auto" keeps it)."""
        return self.resident_copy is not False

    @property
    def q8(self) -> bool:
        """8-bit Adam moments (``moment_dtype="q8"``; capacity mode)."""
        return self.moment_dtype == "q8"

    @property
    def capacity(self) -> bool:
        """Capacity mode: bfloat16 masters and moments, stochastically rounded (``master_dtype``), with or
        without 8-bit moments."""
        return self.precision.stochastic
