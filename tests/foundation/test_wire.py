"""The wire contract: every message round-trips, and the committed stubs match the .proto files."""
from __future__ import annotations

import filecmp
import pathlib

import pytest
from google.protobuf import descriptor

from treeserve import protogen
from treeserve.v1 import treeserve_pb2 as pb

ALL_MESSAGES = sorted(pb.DESCRIPTOR.message_types_by_name)


def _fill(msg, depth: int = 0):
    """Set every field of `msg` to a non-default value (recursively), so a round trip checks all."""
    for field in msg.DESCRIPTOR.fields:
        repeated = field.is_repeated
        if field.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            if depth > 3:
                continue
            if repeated:
                _fill(getattr(msg, field.name).add(), depth + 1)
            else:
                _fill(getattr(msg, field.name), depth + 1)
            continue
        value = {
            descriptor.FieldDescriptor.TYPE_STRING: "x-1",
            descriptor.FieldDescriptor.TYPE_BOOL: True,
            descriptor.FieldDescriptor.TYPE_FLOAT: 0.5,
            descriptor.FieldDescriptor.TYPE_DOUBLE: 0.25,
            descriptor.FieldDescriptor.TYPE_ENUM: 1,
        }.get(field.type, 3)
        if field.containing_oneof is not None and msg.WhichOneof(field.containing_oneof.name):
            continue
        if repeated:
            getattr(msg, field.name).extend([value, value])
        else:
            setattr(msg, field.name, value)
    return msg


@pytest.mark.parametrize("name", ALL_MESSAGES)
def test_message_round_trip(name):
    cls = getattr(pb, name)
    msg = _fill(cls())
    back = cls.FromString(msg.SerializeToString())
    assert back == msg
    if msg.DESCRIPTOR.fields:
        assert msg.ByteSize() > 0


def test_services_declared():
    services = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services["Verifier"] == ["Prefill", "Verify", "VerifyStream", "Commit", "Release", "Stats"]
    assert services["Drafter"] == ["StartSequence", "EndSequence", "Speculate", "Stats"]
    assert services["Generation"] == ["Generate", "Cancel"]
    speculate = pb.DESCRIPTOR.services_by_name["Drafter"].methods_by_name["Speculate"]
    assert speculate.client_streaming and speculate.server_streaming
    verify_stream = pb.DESCRIPTOR.services_by_name["Verifier"].methods_by_name["VerifyStream"]
    assert verify_stream.client_streaming and verify_stream.server_streaming
    assert verify_stream.input_type.name == "VerifyRequest" and verify_stream.output_type.name == "VerifyResponse"
    assert pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name["Generate"].server_streaming


def test_state_changing_requests_carry_length():
    """Idempotency: every state-changing message names the sequence and a committed length."""
    assert "committed_length" in pb.Commit.DESCRIPTOR.fields_by_name
    assert {"sequence_id", "committed_length", "commit"} <= set(pb.VerifyItem.DESCRIPTOR.fields_by_name)
    assert {"sequence_id", "committed_length"} <= set(pb.DraftRequest.DESCRIPTOR.fields_by_name)


def test_committed_stubs_are_fresh(tmp_path):
    protogen.generate(tmp_path)
    committed = pathlib.Path(protogen.ROOT)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        assert filecmp.cmp(tmp_path / rel, committed / rel, shallow=False), (
            f"{rel} is stale: run `python -m treeserve.protogen` and commit the result"
        )
