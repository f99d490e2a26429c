import numpy as np
import orjson
import pytest
import torch
from pydantic import ValidationError
from specbus.core.contracts import (
    MAX_RECORD_BYTES,
    MAX_TASK_BYTES,
    FeatureSpec,
    PromptTask,
    Provenance,
    SampleRef,
)
from specbus.core.errors import RecordError


def make_ref(**over) -> SampleRef:
    spec = FeatureSpec(
        name="hidden_states",
        key="s/x/g0/hidden_states",
        shape=(7, 24),
        dtype="bfloat16",
        nbytes=336,
    )
    fields = dict(
        sample_id="x", run_id="r", task_id="t", task_seq=3, store_uri="shm://s",
        features={"hidden_states": spec}, nbytes=336, num_tokens=7, strategy="eagle3",
        target_fingerprint="tf", tokenizer_fingerprint="kf", provenance=Provenance(producer_id="p0", engine="hf"),
    )  # fmt: skip
    return SampleRef(**{**fields, **over})


def test_round_trip_is_exact_and_frozen():
    ref = make_ref()
    assert SampleRef.from_bytes(ref.to_bytes()) == ref
    with pytest.raises((ValidationError, TypeError)):
        ref.task_seq = 4  # frozen
    task = PromptTask(task_id="t", run_id="r", input_ids=(1, 2, 3), loss_mask=(0, 1, 1), epoch=2)
    assert PromptTask.from_bytes(task.to_bytes()) == task
    assert task.msg_id == "r:t:e2:g0" and ref.msg_id == "r:x:g0"


@pytest.mark.parametrize("payload", [np.arange(4), torch.arange(4), b"\x00\x01"])
def test_no_array_or_tensor_rides_in_a_record(payload):
    with pytest.raises((ValidationError, TypeError)):
        PromptTask(task_id="t", run_id="r", input_ids=payload)
    with pytest.raises((ValidationError, TypeError)):
        FeatureSpec(name="h", key="k", shape=payload, dtype="float32", nbytes=4)


def test_a_tensor_smuggled_into_the_wire_bytes_is_rejected():
    data = orjson.loads(make_ref().to_bytes())
    data["features"]["hidden_states"]["data"] = [0.1] * 16
    with pytest.raises(RecordError) as e:
        SampleRef.from_bytes(orjson.dumps(data))
    assert e.value.reason == "invalid" and "data" in str(e.value)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\xff\xfe garbage", "garbage"),
        (b"[1, 2]", "garbage"),
        (
            orjson.dumps({"schema_version": 3, "task_id": "t", "run_id": "r", "text": "hi"}),
            "schema",
        ),
        (orjson.dumps({"schema_version": 1, "task_id": "t", "run_id": "r"}), "invalid"),
        (b" " * (MAX_TASK_BYTES + 1), "oversize"),
    ],
)
def test_bad_bytes_raise_record_error_with_a_reason(raw, reason):
    with pytest.raises(RecordError) as e:
        PromptTask.from_bytes(raw)
    assert e.value.reason == reason


def test_oversize_record_refused_at_write():
    with pytest.raises(RecordError) as e:
        PromptTask(task_id="t", run_id="r", input_ids=tuple(range(1_100_000))).to_bytes()
    assert e.value.reason == "oversize"
    with pytest.raises(RecordError) as e:
        make_ref(store_uri="mem://" + "x" * MAX_RECORD_BYTES).to_bytes()
    assert e.value.reason == "oversize"


def test_a_128k_token_task_travels_packed_in_under_a_stock_brokers_megabyte():
    ids = tuple(range(3, 131_075))
    mask = (0,) * 1000 + (1,) * (len(ids) - 1000)
    task = PromptTask(task_id="t", run_id="r", input_ids=ids, loss_mask=mask)
    data = task.to_bytes()
    assert len(data) < 1 << 20  # a stock nats-server's max_payload
    wire = orjson.loads(data)
    assert wire["schema_version"] == 2
    assert isinstance(wire["input_ids"], str) and isinstance(wire["loss_mask"], str)
    back = PromptTask.from_bytes(data)
    assert back == task and back.input_ids == ids and back.loss_mask == mask
    assert PromptTask.model_validate_json(data) == task  # the lease's happy path


def test_a_version_1_task_is_read_and_written_back_as_version_2():
    old = orjson.dumps({"schema_version": 1, "task_id": "t", "run_id": "r", "epoch": 1,
                        "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})  # fmt: skip
    task = PromptTask.from_bytes(old)
    assert task.input_ids == (5, 6, 7) and task.loss_mask == (0, 1, 1)
    assert task.schema_version == 2 and task.msg_id == "r:t:e1:g0"
    assert orjson.loads(task.to_bytes())["schema_version"] == 2
    assert PromptTask.from_bytes(task.to_bytes()) == task


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"input_ids": "AAA"}, "not base64"),
        ({"input_ids": "AAAAAAA="}, "whole number of int32"),
        ({"input_ids": "/////w=="}, "negative"),
        ({"input_ids": "BQAAAA==", "loss_mask": "Ag=="}, "past the last token"),
        ({"input_ids": "BQAAAA==", "loss_mask": "AQI="}, "do not hold"),
        ({"text": "hi", "loss_mask": "AQ=="}, "needs input_ids"),
    ],
)
def test_a_corrupt_packed_task_is_invalid(fields, words):
    raw = orjson.dumps({"schema_version": 2, "task_id": "t", "run_id": "r", **fields})
    with pytest.raises(RecordError, match=words) as e:
        PromptTask.from_bytes(raw)
    assert e.value.reason == "invalid"


def test_nbytes_must_add_up_and_masks_must_be_binary():
    with pytest.raises(Exception, match="nbytes"):
        make_ref(nbytes=1)
    with pytest.raises(Exception, match="loss_mask"):
        PromptTask(task_id="t", run_id="r", input_ids=(1, 2), loss_mask=(0, 2))
    with pytest.raises(Exception, match="differ in length"):
        PromptTask(task_id="t", run_id="r", input_ids=(1, 2), loss_mask=(0,))


def test_the_manifest_is_a_versioned_record_with_room_for_a_vocab_table():
    from specbus.core.contracts import Manifest, ManifestTarget, VocabTable
    from specbus.core.data.vocab import VocabMapping

    manifest = Manifest(
        run="r", plan={"num_samples": 3}, plan_hash="abc", planned_tasks=3, strategy="eagle3",
        target=ManifestTarget(model="m", fingerprint="f", tokenizer_fingerprint="t",
                              num_layers=2, hidden_size=8, vocab_size=200_000),
        vocab=VocabTable(d2t=tuple(range(0, 144_000, 3)), target_vocab_size=200_000),
    )  # fmt: skip
    data = manifest.to_bytes()
    assert len(data) > MAX_RECORD_BYTES  # a 48k draft vocab over a large target vocabulary
    assert Manifest.from_bytes(data) == manifest
    vocab = VocabMapping.from_d2t(manifest.vocab.d2t, manifest.vocab.target_vocab_size)
    assert vocab.draft_vocab_size == 48_000 and int(vocab.t2d.sum()) == 48_000
    with pytest.raises(RecordError) as e:
        Manifest.from_bytes(data.replace(b'"schema_version":1', b'"schema_version":2'))
    assert e.value.reason == "schema"
