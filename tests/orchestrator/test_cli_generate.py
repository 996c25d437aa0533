"""`treeserve generate`'s exit status: 0 only for a whole completion (it ended at its length, an
EOS or a stop string); a completion cancelled from elsewhere, or a stream that ended without a
finish, is 1, as is a failed call."""
import argparse

import grpc
import pytest

from orchestrator import cli_generate
from treeserve.server import Server
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg


class ScriptedGeneration(pbg.GenerationServicer):
    """Streams two tokens, then a last message with `finish` (None: no last message at all)."""

    def __init__(self, finish):
        self.finish = finish

    def Generate(self, request, context):
        yield pb.GenerateResponse(request_id="r", token_ids=[7, 8])
        if self.finish is not None:
            yield pb.GenerateResponse(request_id="r", finish_reason=self.finish, generated_tokens=2)


def generate(servicer, capsys) -> tuple[int, str, str]:
    """`treeserve generate --tokens "1 2"` against a real server of `servicer` -> (exit status, stdout, stderr)."""
    server = Server("127.0.0.1:0").add(pbg.add_GenerationServicer_to_server, servicer, "Generation").start()
    try:
        p = argparse.ArgumentParser()
        cli_generate.add_arguments(p)
        code = cli_generate.run(p.parse_args(["--address", f"127.0.0.1:{server.port}", "--tokens", "1 2",
                                              "--timeout", "30"]))
    finally:
        server.stop(grace=0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("finish, expected", [
    (pb.FINISH_REASON_LENGTH, 0), (pb.FINISH_REASON_EOS, 0), (pb.FINISH_REASON_STOP, 0),
    (pb.FINISH_REASON_CANCELLED, 1), (None, 1)])
def test_only_a_whole_completion_exits_0(finish, expected, capsys):
    code, out, _ = generate(ScriptedGeneration(finish), capsys)
    assert out.split() == ["7", "8"]  # the tokens that came are shown whatever the end
    assert code == expected


def test_a_failed_call_exits_1_with_one_line(capsys):
    class Refusing(pbg.GenerationServicer):
        def Generate(self, request, context):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "every sequence slot is taken")

    code, _, err = generate(Refusing(), capsys)
    assert code == 1 and err.strip() == "treeserve generate: RESOURCE_EXHAUSTED: every sequence slot is taken"
