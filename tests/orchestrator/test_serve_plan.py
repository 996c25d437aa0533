"""`treeserve serve` turns its flags into a plan for its child services."""
import argparse

import pytest

from orchestrator.cli_serve import SetupError, add_arguments, plan_from


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_default_plan_is_the_demo_pair_without_trimming():
    plan = plan_from(parse("--device", "cpu"))
    assert plan.drafter is not None and plan.drafter.name == "drafter" and not plan.ngram
    assert plan.drafter_trim_vocab is None


def test_trimmed_vocabulary_reaches_the_plan(tmp_path):
    trim = tmp_path / "vocab_subset.json"
    trim.write_text("{}")  # the drafter validates the contents when it loads it
    plan = plan_from(parse("--device", "cpu", "--drafter-trim-vocab", str(trim)))
    assert plan.drafter_trim_vocab == trim


def test_trimmed_vocabulary_needs_a_draft_model(tmp_path):
    trim = tmp_path / "vocab_subset.json"
    trim.write_text("{}")
    with pytest.raises(SetupError, match="needs a draft model"):
        plan_from(parse("--device", "cpu", "--ngram", "--drafter-trim-vocab", str(trim)))


def test_missing_trimmed_vocabulary_file_is_a_clear_error(tmp_path):
    with pytest.raises(SetupError, match="not found"):
        plan_from(parse("--device", "cpu", "--drafter-trim-vocab", str(tmp_path / "nope.json")))


def test_a_taken_public_port_is_one_line_before_anything_starts():
    import socket

    from orchestrator.cli_serve import LaunchFailed, launch_or_say_why
    from orchestrator.runtime import OrchestratorConfig

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = OrchestratorConfig(verifiers=[], host="127.0.0.1", port=port, quiet=True)
        with pytest.raises(LaunchFailed, match=f"cannot take 127.0.0.1:{port}"):
            launch_or_say_why(plan_from(parse("--device", "cpu", "--ngram")), config)


def test_a_verifier_that_cannot_load_its_model_is_one_line(tmp_path):
    """The child's own last words, not a traceback through the launcher."""
    import pathlib
    import shutil

    from orchestrator.cli_serve import LaunchFailed, launch_or_say_why
    from orchestrator.runtime import OrchestratorConfig

    target = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(target / "config.json", broken / "config.json")  # no weights
    config = OrchestratorConfig(verifiers=[], port=0, quiet=True)
    with pytest.raises(LaunchFailed) as failed:
        launch_or_say_why(plan_from(parse("--device", "cpu", "--ngram", "--model", str(broken))), config, str(tmp_path))
    message = str(failed.value)
    assert "\n" not in message and "verifier-0 exited" in message and "safetensors" in message
    assert message.endswith(f"(logs in {tmp_path})")


def test_a_child_that_exited_is_told_before_a_ray_that_timed_out_beside_it(tmp_path):
    """On a busy machine Ray can time out while a verifier fails to load: the verifier's own
    failure is the one a user can fix, so it is the one raised (Ray's is its cause)."""
    from orchestrator.cli_serve import prepare_beside
    from orchestrator.procs import Child

    class RayTimingOut:
        def prepare(self):
            raise TimeoutError("Timed out waiting for file gcs_server_port")

    exited = Child(["verifier", "--no-such-option"], "verifier-0", log_path=str(tmp_path / "verifier-0.log"))
    try:
        exited.proc.wait(60)
        with pytest.raises(RuntimeError, match="verifier-0 exited with 2") as failed:
            prepare_beside(RayTimingOut(), [exited])
        assert isinstance(failed.value.__cause__, TimeoutError)
        with pytest.raises(TimeoutError, match="gcs_server_port"):  # no child has exited: Ray's own
            prepare_beside(RayTimingOut(), [])
    finally:
        exited.stop()


def test_the_fronts_limits_are_options_of_serve_as_of_orchestrator():
    """`serve` takes the Generation front's limits as `orchestrator` does; a default above the
    largest allowed (every request naming none would be refused) is a clear exit."""
    from orchestrator.cli_orchestrator import limits_from

    limits = limits_from(parse("--max-streams", "8", "--max-new-tokens", "100", "--default-max-new-tokens", "50",
                               "--max-prompt-tokens", "1000"))
    assert (limits.max_streams, limits.max_new_tokens, limits.default_max_new_tokens, limits.max_prompt_tokens) == \
        (8, 100, 50, 1000)
    with pytest.raises(SystemExit, match="default_max_new_tokens"):
        limits_from(parse("--max-new-tokens", "100"))  # the default default, 256, is above it
    with pytest.raises(SystemExit):
        parse("--default-max-new-tokens", "0")


def test_generate_takes_its_token_from_the_environment(monkeypatch):
    from orchestrator import cli_generate

    def parse_generate(*argv):
        p = argparse.ArgumentParser()
        cli_generate.add_arguments(p)
        return p.parse_args(list(argv))

    monkeypatch.delenv(cli_generate.AUTH_TOKEN_ENV, raising=False)
    assert cli_generate.auth_token(parse_generate("hi")) is None
    monkeypatch.setenv(cli_generate.AUTH_TOKEN_ENV, "s3cret")
    assert cli_generate.auth_token(parse_generate("hi")) == "s3cret"
    assert cli_generate.auth_token(parse_generate("hi", "--auth-token", "other")) == "other"


def test_generate_names_the_variable_that_holds_a_bad_token(monkeypatch, capsys):
    from orchestrator import cli_generate

    p = argparse.ArgumentParser()
    cli_generate.add_arguments(p)
    monkeypatch.setenv(cli_generate.AUTH_TOKEN_ENV, "two words")
    assert cli_generate.run(p.parse_args(["hi", "--address", "127.0.0.1:1"])) == 2
    err = capsys.readouterr().err
    assert f"${cli_generate.AUTH_TOKEN_ENV} must be visible ASCII" in err and "--auth-token" not in err
