"""Write a speculators dataset directory and read the dump back with speculators' own reader.

Run by tests/test_speculators_dump.py as `python -m tests.speculators_dump DIR ROWS OUT` with
the pinned speculators 0.9.0 (and `datasets`) on PYTHONPATH (tests/fixtures/vllm.py). Writes
the rows of ROWS (a JSON list of {input_ids, loss_mask}) into DIR as speculators'
`prepare-data` leaves them (a `datasets` directory, `save_to_disk`, columns input_ids,
loss_mask, seq_len); the test wrote `DIR/hidden_states/hs_<i>.safetensors` as
`generate-offline-data` does. Then speculators' trainer dataset (`ArrowDataset`, files read by
`hs_connectors.FileTransfer`, missing ones an error) reads every row, and OUT gets what its
`_get_raw_data` returns (hidden_states, verifier_last_hidden_states, input_ids, loss_mask).
"""

from __future__ import annotations

import json
import sys

import torch


def main(root: str, rows: str, out: str) -> None:
    import pyarrow as pa
    from datasets import Dataset
    from speculators.train.data import ArrowDataset

    with open(rows) as f:
        given = json.load(f)
    table = pa.table({
        "input_ids": [r["input_ids"] for r in given],
        "loss_mask": [r["loss_mask"] for r in given],
        "seq_len": [len(r["input_ids"]) for r in given],
    })  # fmt: skip
    # a fingerprint given: datasets' own hashing of the table (dill) fails in this mixed
    # environment (`Can't pickle MonthDayNano`); the directory it writes is the same
    dataset = Dataset(table, fingerprint="specbus-test")
    dataset.set_format("torch")  # as prepare-data leaves it (tensors per row)
    dataset.save_to_disk(root)
    data = ArrowDataset(max_len=4096, datapath=root, on_missing="raise",
                        hidden_states_dtype=torch.float32)  # fmt: skip
    torch.save([data._get_raw_data(i) for i in range(len(data))], out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
