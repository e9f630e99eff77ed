"""The analytic model: per-rank bytes, messages and FLOPs of training a transformer, without running it.

Every technique answers *where does each byte live, and which messages move it?*
The ledger measures the answer for minizero's own models; this module predicts it
for any transformer and any strategy, from the formulas of the papers::

    per rank = parameters + gradients + optimizer_state     model states  (ZeRO, section 3 + 5, Figure 1)
             + activations                                   saved for backward (Korthikanti et al. 2022, 4-5)
             + comm_buffers + gathered                       reduce buckets, p2p, ZeRO-3's gathered layer
             (+ offloaded: bytes moved to host memory, not on the device;
                + nvme: bytes moved to files, in no memory at all)

Units: every function returns **bytes** (Python ints) unless its name says
otherwise; sizes of tensors are *elements*. When printing, say which unit:
``GB`` = 10**9 bytes (the ZeRO paper's unit, :func:`gb`), ``GiB`` = 2**30 bytes
(what ``nvidia-smi`` and minizero's ledger print, :func:`gib`).

Symbols (Korthikanti et al. 2022, Table 1): a heads, b micro-batch size, h hidden
size, L layers, p pipeline size, s sequence length, t tensor-parallel size,
V vocabulary, f FFN size, c context-parallel size (s/c tokens per rank); Psi parameters, N_d data-parallel size, K optimizer
bytes per parameter (Rajbhandari et al. 2020, section 3.1).

Two accountings:

* ``"paper"`` — the papers' layouts. Activations as Korthikanti et al. 2022,
  section 4.1 count them: 16-bit (the precision's element size), 1-byte dropout
  masks, small per-row statistics ignored (reproduces ``sbh(34 + 5as/h)`` and
  Table 2); vocab-parallel embedding and head (Megatron-LM); a fixed-size reduce
  bucket; ZeRO-3 prefetching one unit ahead.
* ``"minizero"`` — exactly what minizero does: what its Functions save
  (``autograd/functional.py``, ``ops.py``, ``nn/gpt.py``: float32/float64
  elements, layer-norm mean and rstd, int64 token ids, the logits in their own
  dtype), its replicated embedding and head under tensor parallelism, its
  buffers (``parallel/data_parallel.py``, ``memory/zero.py``) and its 8-bit Adam.
  ``tests/test_estimator.py`` checks it against the ledger (data parallel, ZeRO
  1-3, with and without ``Strategy.overlap``, tensor parallel, pipeline, recompute, dropout);
  ``tests/test_compare.py``
  for every strategy of ``python -m minizero.compare`` (FP16 mixed precision,
  optimizer and activation offload to cpu and nvme, and their combinations with
  ZeRO and recompute) at 1, 2 and 4 ranks.

Sources: Rajbhandari et al. 2020, "ZeRO" (arXiv:1910.02054); Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198); Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters" (arXiv:2104.04473); Huang et al. 2019 "GPipe"; Ren et
al. 2021 "ZeRO-Offload"; Rajbhandari et al. 2021 "ZeRO-Infinity"; Dettmers et al.
2022 "8-bit Optimizers via Block-wise Quantization"; Kaplan et al. 2020.
"""
from __future__ import annotations

from minizero.memory.estimator.model import (  # noqa: F401 (the package's API)
    ACCOUNTINGS, ATTENTIONS, CATEGORIES, DEVICE_CATEGORIES, MIN_8BIT_SIZE, OFFLOAD, OFFLOAD_MIN_BYTES, OFFLOAD_TIERS,
    OPTIMIZERS, PRECISIONS, QUANT_BLOCK, RECOMPUTE, SCHEDULES, ZERO_STAGES, ModelShape, Strategy, _bytes, as_shape,
    gb, gib, model_state_bytes, precision_for_dtype, stage_parameters)
from minizero.memory.estimator.activations import (  # noqa: F401
    Saved, activation_bytes, in_flight, layer_activation_bytes, layer_rows, saved_outside_layers, saved_per_layer)
from minizero.memory.estimator.totals import MemoryEstimate, estimate_memory, estimate_stages  # noqa: F401
from minizero.memory.estimator.traffic import (  # noqa: F401
    comm_bytes_per_step, kaplan_flops, korthikanti_flops, model_flops_per_step, ring_attention_bytes)
