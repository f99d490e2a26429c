"""Per-request row bookkeeping of the SGLang capture layer: engine-version free, no sglang import.

A sampled request carries one `Rows` (on the SGLang `Req` object, so it dies with the request).
Each forward that fed the request some tokens hands it the rows of those tokens with the
position of the first one: prefill chunks (`position` = the chunk's prefix length) and decode
steps (`position` = the fed token's index). Rows are taken only when they continue exactly
where the previous ones ended; anything else (a radix-cache prefix hit, a missed chunk, a
retraction that re-prefills) marks the capture `broken` with the reason, and a broken capture
is never submitted. The predecessor's bug this prevents: a 64-token prefix hit captured a
prompt 64 rows short and crashed a trainer 1,570 steps later.

At the end (`finish`), the capture holds `prompt + output[:-1]` rows exactly: rows past that
(an overlap-scheduler overshoot step) are cut, fewer rows are `incomplete`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Rows:
    """The captured rows of one request (aux: `[n, len(layers) * H]`, final: `[n, H]` or none)."""

    request_id: str
    sample_id: str
    aux: list[torch.Tensor] = field(default_factory=list)
    final: list[torch.Tensor] = field(default_factory=list)
    num_rows: int = 0
    broken: str = ""  # why the capture is not whole; "" while it is

    def take(self, position: int, aux: torch.Tensor, final: torch.Tensor | None) -> bool:
        """Append the rows of tokens `position, position + 1, ...`; False (and `broken` set) when
        they do not continue the rows so far, or the final rows are missing after some came."""
        if self.broken:
            return False
        if position != self.num_rows:
            self.broken = (
                f"prefix_hit: rows from position {position}, expected {self.num_rows}"
                if self.num_rows == 0
                else f"gap: rows from position {position}, expected {self.num_rows}"
            )
            return False
        if final is not None and final.shape[0] != aux.shape[0]:
            self.broken = f"final rows {final.shape[0]} != aux rows {aux.shape[0]}"
            return False
        if (final is None) != (not self.final) and self.num_rows:
            self.broken = "final rows in some forwards only"
            return False
        self.aux.append(aux)
        if final is not None:
            self.final.append(final)
        self.num_rows += int(aux.shape[0])
        return True

    def finish(self, num_prompt: int, num_output: int) -> str:
        """Cut to the `num_prompt + num_output - 1` rows fed; returns "" or why it is unusable."""
        if self.broken:
            return self.broken
        want = num_prompt + num_output - 1
        if self.num_rows < want:
            self.broken = f"incomplete: {self.num_rows} rows of {want}"
            return self.broken
        if self.num_rows > want:  # an overshoot decode step after the finish
            self.aux = [torch.cat(self.aux)[:want]]
            self.final = [torch.cat(self.final)[:want]] if self.final else []
            self.num_rows = want
        return ""


def row_slices(lengths: list[int]) -> list[slice]:
    """The rows of each request of a batch in a full-capture output: lengths laid end to end."""
    out, start = [], 0
    for n in lengths:
        out.append(slice(start, start + n))
        start += n
    return out
