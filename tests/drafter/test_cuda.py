"""The drafter on CUDA: captured CUDA graphs (the default there) draft the trees eager mode drafts,
with and without draft-ahead; a trimmed head works on the device; speculative output is the
target's own. fp32 throughout (TF32 off), so eager and graph replays compute the same numbers up
to kernel rounding; tree comparisons use the trained demo drafter, whose distributions are peaked
enough that rounding does not reorder candidates. Skipped without CUDA."""
import pathlib
import random

import pytest
import torch

from drafter_service.ahead import AheadConfig
from drafter_service.draftlm import DraftModel
from drafter_service.engine import Drafter, Options
from drafter_service.vocab import TrimmedVocab
from models.buckets import NODE_BUCKETS
from tests.drafter.compare import assert_same_replies
from tests.drafter.test_ahead import drive
from tests.drafter.test_growth import assert_one_growth_serves, growths_built_by_a_tree
from tests.drafter.test_trimmed import GREEDY, HOT, VOCAB, greedy_reference, kept_ids, save, speculate

DEMO = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "drafter"
CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def load(path, **kw) -> DraftModel:
    return DraftModel.load(str(path), device="cuda", dtype=torch.float32, max_slots=48, max_len=1024, **kw)


@pytest.fixture(scope="module")
def pair():
    return load(DEMO, cuda_graphs=False), load(DEMO)


@pytest.fixture(scope="module")
def demo_prompt(pair):
    return pair[0].lm.tokenizer(CODE * 3)["input_ids"]


def test_graphs_are_on_by_default_and_captured_at_load(pair):
    eager, graphed = pair
    runner = graphed.lm.graphs
    assert eager.lm.graphs is None and runner is not None and runner.capture
    assert not runner.failures, runner.failures
    assert sorted(runner._verify) == [(1, n) for n in NODE_BUCKETS] and 1 in runner._decode
    assert runner.stash.rows == max(NODE_BUCKETS)
    assert sorted(runner._chain) == list(NODE_BUCKETS)  # its starts and catch-ups
    assert sorted(runner._chain_commit) == [(1, n) for n in NODE_BUCKETS]
    assert sorted(runner._chunk) == sorted(runner.prefill_chunks) and runner.prefill_chunks


CASES = [("dynamic", GREEDY, True), ("dynamic", HOT, True), ("static", GREEDY, False), ("chain", HOT, False)]


@pytest.mark.parametrize("shape,sampling,ahead", CASES,
                         ids=[f"{s}-{'greedy' if p.greedy else 'sampling'}{'-ahead' if a else ''}" for s, p, a in CASES])
def test_graph_replays_draft_the_trees_eager_mode_drafts(pair, demo_prompt, shape, sampling, ahead):
    eager, graphed = pair
    config = AheadConfig(trees=3, fanout=2) if ahead else None
    want, calls, probs_e, _ = drive(eager, demo_prompt, sampling, shape, config)
    got, _, probs_g, _ = drive(graphed, demo_prompt, sampling, shape, config, calls=calls)
    assert_same_replies(got, want, prob_tol=1e-5)
    assert (probs_g - probs_e).abs().max() < 1e-4
    assert not graphed.lm.graphs.failures


def test_trimmed_head_on_cuda_matches_the_full_head(pair, demo_prompt, tmp_path):
    """Every id kept, in another order: the same trees as the full head."""
    eager, _ = pair
    order = list(range(1, 4096))
    random.Random(3).shuffle(order)
    path = TrimmedVocab(tuple([0] + order), 4096, (0,)).save(tmp_path / "all.json")
    permuted = load(DEMO, trim=path)
    assert permuted.head.ids.is_cuda and permuted.lm.graphs is not None
    want, calls, _, _ = drive(eager, demo_prompt, GREEDY, "dynamic", AheadConfig(trees=3, fanout=2))
    got, _, _, _ = drive(permuted, demo_prompt, GREEDY, "dynamic", AheadConfig(trees=3, fanout=2), calls=calls)
    assert_same_replies(got, want, prob_tol=1e-5)


@pytest.mark.parametrize("ahead", [False, True], ids=["fresh", "ahead"])
def test_trimmed_graphed_self_drafting_gives_the_targets_greedy_output(tiny_pair, prompt, ahead):
    from models import HybridLM

    target = HybridLM.from_pretrained(tiny_pair[0], device="cuda", dtype=torch.float32, max_slots=2, max_len=512)
    ids = kept_ids(VOCAB // 2, seed=6)
    model = load(tiny_pair[0], trim=save(tiny_pair, ids))
    d = Drafter(model, Options("dynamic", 10, 4, ahead), ahead=AheadConfig(trees=2, fanout=2) if ahead else None)
    try:
        out, forwards = speculate(target, d, prompt, 40)
    finally:
        d.close()
    assert out == greedy_reference(target, prompt, 40)
    assert forwards < 32 and not model.lm.graphs.failures


@pytest.mark.parametrize("rule", ["greedy", "ranked", "drawn"])
def test_trees_grown_in_graphs_equal_the_host_loop(pair, demo_prompt, rule):
    """Dynamic trees grown by graph replays (`drafter_service.growth`) are the host loop's trees."""
    from drafter_service.children import ChildPicker, PickRule
    from drafter_service.dynamic import DynamicProposer
    from drafter_service.state import DraftState
    from treeserve.sampling import Sampling

    graphed = pair[1]
    s = {"greedy": Sampling(), "ranked": Sampling(temperature=0.7, top_k=50, seed=3),
         "drawn": Sampling(temperature=1.0, seed=4)}[rule]
    picker = ChildPicker(s, PickRule(rule))
    state = DraftState.open("g", demo_prompt[:-8], s, picker, graphed)
    proposer = DynamicProposer()
    try:
        for budget, depth in [(4, 3), (16, 6), (32, 6), (64, 8)]:
            for root in demo_prompt[-8:-4]:
                grown = proposer.propose(state, root, budget, depth)
                plain = proposer.propose_on_host(state, root, budget, depth)
                assert (grown.tree.tokens, grown.tree.parents) == (plain.tree.tokens, plain.tree.parents)
                assert grown.logp == pytest.approx(plain.logp, abs=1e-4)
                state.advance([root])
    finally:
        state.release()
    assert not graphed.lm.graphs.failures, graphed.lm.graphs.failures
    assert all(type(steps).__name__ == "_GraphSteps" for _, steps in graphed._growths.values())


def test_one_captured_growth_serves_every_temperature_top_k_and_top_p(pair, demo_prompt, monkeypatch):
    """Requests that differ in temperature, top-k, top-p and seed but not in which truncations
    apply replay one captured growth; each grows the host loop's tree, and the transform with its
    values in a device tensor is the transform itself, bit for bit, on CUDA."""
    from drafter_service.children import PickRule
    from treeserve import sampling
    from treeserve.sampling import Sampling

    graphed = pair[1]
    settings = [Sampling(temperature=t, top_k=k, top_p=p, seed=i)
                for i, (t, k, p) in enumerate([(1.0, 20, 0.9), (0.4, 5, 0.6), (1.6, 200, 0.99)])]
    logits = torch.randn(16, 4000, device="cuda") * 6
    logits[0, :1000] = logits[0, 0]  # ties
    logits[1, -7:] = float("-inf")
    extra = [Sampling(temperature=0.9, top_k=4000), Sampling(temperature=1.2, top_k=9000, top_p=1.0),
             Sampling(temperature=0.5, top_p=1.0), Sampling(temperature=2.0, top_k=1, top_p=0.2)]
    for s in settings + extra:
        values = sampling.transform_values(s).cuda()
        got, want = sampling.transform_by(logits, values, s.truncations), sampling.transform(logits, s)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), s
    # room for the shape, whatever the module's earlier drafters captured on this model
    monkeypatch.setattr(graphed, "_growths", type(graphed._growths)())
    growth, steps = assert_one_growth_serves(graphed, demo_prompt, [(s, PickRule.DRAWN) for s in settings], 12, 5,
                                             abs_logp=1e-4)
    assert type(steps).__name__ == "_GraphSteps" and growth.picker.sampling == settings[0]
    assert not graphed.lm.graphs.failures, graphed.lm.graphs.failures


def test_a_drafter_captures_its_default_growths_at_start_up(pair, demo_prompt, monkeypatch):
    """A drafter on a model with captured graphs captures the default shape's growths when it is
    built; a first tree of one of them, at a temperature not seen before, captures nothing."""
    import time

    from drafter_service import draftlm
    from drafter_service.children import ChildPicker, PickRule
    from treeserve.sampling import Sampling

    graphed = pair[1]
    # room for every start-up shape, whatever the module's earlier tests captured on this model
    monkeypatch.setattr(graphed, "_growths", type(graphed._growths)())
    t0 = time.perf_counter()
    drafter = Drafter(graphed, Options("dynamic", 16, 6, False), max_sequences=2, ahead=None, background_sweep=False)
    print(f"start-up growths: {len(graphed._growths)} in {time.perf_counter() - t0:.1f} s")
    pickers = [ChildPicker(Sampling(), PickRule.GREEDY, drafter.support).bind(graphed.head),
               ChildPicker(Sampling(temperature=1.0), PickRule.DRAWN, drafter.support).bind(graphed.head)]
    want = {draftlm._growth_key(b, min(6, b - 1), p) for b in (2, 4, 8, 16, 32) for p in pickers}
    assert set(graphed._growths) == want
    assert all(type(steps).__name__ == "_GraphSteps" for _, steps in graphed._growths.values())
    s = Sampling(temperature=0.35, seed=21)
    assert growths_built_by_a_tree(graphed, demo_prompt, s, 32, 6, monkeypatch) == []
    assert not graphed.lm.graphs.failures
