"""The capture audit: a sampled fraction of captured samples recomputed by a reference forward
of the same target and compared layer by layer (docs/architecture.md, "Capture audit").

Whatever engine captured a sample (the hf engine in a producer, a TP engine, an SGLang or
vLLM server through its capture layer), the trainer that leases it may recompute its features
from its own input ids with a reference forward (the hf engine: `reference(input_ids) ->
features`) and compare them. A wrong aux layer (an off-by-one layer id, a wrong TP gather, a
server started with another model) trains a draft for weeks on the wrong inputs without any
error anywhere else; here it is a counted, logged, dead-lettered (`capture_mismatch`) sample.

- Which samples: `audit_decision(sample_id, rate)`, a pure function of the sample id (every
  rank, and a redelivery, decides the same).
- The comparison (`compare`): the input ids must be equal; each aux layer's block of the aux
  feature and the final feature are compared by relative error `||c - r|| / ||r||` over the
  rows; a capture is wrong when one exceeds the tolerance of the captured dtype (`TOLERANCE`,
  or `audit.tolerance`). The reference runs in float32. Measured on SmolLM2-135M (30 layers,
  256 tokens, CPU): a bf16 capture of the right layers is within 0.15-0.6 % (the final state
  1.1 %); every layer one too deep gives 46 % at layer 1, 3.3 % at layer 14, 13 % at layer 26:
  the bf16 tolerance (5 %) catches a systematic shift through the early and late layers, while
  a shift of a middle layer alone needs a tighter `audit.tolerance` (2 % separates both here).
- Failure to build or run the reference turns the audit off for the process (one error line,
  never an error in training).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # torch only where a sample is compared (the config imports this module)
    import torch

log = logging.getLogger("specbus.audit")

# relative error per layer above which a capture of that dtype is wrong (the reference is fp32)
TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}


class AuditConfig(BaseModel):
    """The `audit` section of the run config (a `core.config.Section`: strict): a trainer
    recomputes `rate` of the samples it leases (by sample id; 0: off) that were captured by
    one of `engines` with the hf engine on `device` ("auto": the trainer's accelerator) and
    dead-letters one whose relative error in a layer is above `tolerance` (None: by the
    captured dtype, `TOLERANCE`).

    By default only captures of a serving engine (SGLang, vLLM) are audited: an hf capture
    comes from the reference's own code, and recomputing it would only cost the trainer a
    target forward (add "hf" to `engines` to audit those too)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rate: float = Field(0.01, ge=0, le=1)
    engines: list[str] = ["sglang", "sglang_server", "vllm", "vllm_server"]
    device: str = "auto"
    tolerance: float | None = Field(None, gt=0)


def audit_decision(sample_id: str, rate: float) -> bool:
    """Whether a sample is audited: a pure function of its id."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    digest = hashlib.sha256(f"specbus-audit:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < rate


@dataclass(frozen=True)
class LayerError:
    """The relative error of one compared block: `layer` is the target layer (0-based
    output) of an aux block, or "final" / the feature name."""

    feature: str
    layer: int | str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


@dataclass(frozen=True)
class AuditResult:
    """Every compared block; `ok` when all are within tolerance."""

    errors: tuple[LayerError, ...]
    problem: str = ""  # a mismatch that is not a layer's (the input ids, a shape)

    @property
    def ok(self) -> bool:
        return not self.problem and all(e.ok for e in self.errors)

    def describe(self) -> str:
        """One line: what is off, by layer, worst first."""
        if self.problem:
            return self.problem
        bad = sorted((e for e in self.errors if not e.ok), key=lambda e: -e.error / e.tolerance)
        shown = bad or sorted(self.errors, key=lambda e: -e.error)[:1]
        return "; ".join(f"{e.feature} layer {e.layer}: relative error {e.error:.3g} "
                         f"(tolerance {e.tolerance:g})" for e in shown)  # fmt: skip


def _relative(captured: torch.Tensor, reference: torch.Tensor) -> float:
    c, r = captured.double(), reference.double()
    return float((c - r).norm() / r.norm().clamp_min(1e-12))


def compare(captured: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], contract,
            tolerance: float | None = None) -> AuditResult:  # fmt: skip
    """`captured` against `reference` (features of `contract`), layer by layer (module doc)."""
    import torch

    ids = captured.get("input_ids")
    if ids is None or not torch.equal(
        ids.reshape(-1).long(), reference["input_ids"].reshape(-1).long()
    ):
        return AuditResult((), "input_ids differ from the reference's")
    errors = []
    for name, layers in ((contract.aux_feature, list(contract.aux_layers)),
                         (contract.final_feature, ["final"])):  # fmt: skip
        if name is None or name not in captured or name not in reference:
            continue
        c, r = captured[name], reference[name].to(captured[name].device)
        if c.shape != r.shape:
            return AuditResult((), f"{name}: shape {tuple(c.shape)} != reference {tuple(r.shape)}")
        tol = tolerance if tolerance is not None else TOLERANCE.get(str(c.dtype)[6:], 5e-2)
        width = c.shape[-1] // len(layers)
        for j, layer in enumerate(layers):
            block = slice(j * width, (j + 1) * width)
            errors.append(LayerError(name, layer, _relative(c[..., block], r[..., block]), tol))
    return AuditResult(tuple(errors))


@dataclass
class CaptureAudit:
    """One trainer process's audit: `reference(input_ids [L]) -> features` (built lazily by
    `make_reference`, the first time a sample is audited), `rate`, `tolerance` (None: by
    dtype). `counts` (audited, mismatches) are this process's; `name` keys them in the run KV."""

    rate: float
    make_reference: Callable[[], Callable[[torch.Tensor], dict[str, torch.Tensor]]]
    contract: object
    tolerance: float | None = None
    name: str = "rank0"
    engines: tuple[str, ...] | None = None  # audited capture engines (None: every one)
    counts: dict[str, int] = field(default_factory=lambda: {"audited": 0, "mismatches": 0})
    disabled: str = ""
    _reference: Callable | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # samples that passed here (a redelivery is not recomputed again), the last `remember`
    _passed: dict = field(default_factory=dict)
    remember: int = 65536

    def wants(self, sample_id: str, generation: int = 0, engine: str | None = None) -> bool:
        """Whether this sample is audited here: captured by one of `engines` (None: any),
        sampled by its id, and not already passed."""
        return (not self.disabled and (self.engines is None or engine in self.engines)
                and audit_decision(sample_id, self.rate)
                and (sample_id, generation) not in self._passed)  # fmt: skip

    def passed(self, sample_id: str, generation: int = 0) -> None:
        """Remember that this sample passed (bounded: the oldest is forgotten)."""
        self._passed[(sample_id, generation)] = None
        if len(self._passed) > self.remember:
            del self._passed[next(iter(self._passed))]

    def check(self, tensors: dict[str, torch.Tensor]) -> AuditResult | None:
        """Recompute and compare one sample (blocking: a forward); None when the audit is off
        (the reference could not be built or run: logged once, the audit stays off)."""
        with self._lock:  # one reference forward at a time
            try:
                if self._reference is None:
                    self._reference = self.make_reference()
                reference = self._reference(tensors["input_ids"].reshape(-1))
            except Exception as e:  # noqa: BLE001 - the audit must never stop training
                self.disabled = f"{type(e).__name__}: {e}"
                log.error("capture audit off for this trainer: the reference forward failed "
                          "(%s); set audit.rate=0 or audit.device", self.disabled)  # fmt: skip
                return None
        result = compare(tensors, reference, self.contract, self.tolerance)
        self.counts["audited"] += 1
        if not result.ok:
            self.counts["mismatches"] += 1
        return result
