"""Speculative methods on the real SmolLM2 target in fp32: greedy output is token-for-token vanilla's for
every method (untrained heads included: losslessness cannot depend on the draft), batching does not change
outputs, caches are returned, and bad configurations fail with clear errors."""
import pytest
import torch

from engine.heads import new_head
from engine.llm import LLM
from engine.loader import ModelNotFoundError
from engine.run import default_method, main
from engine.scheduler import SamplingParams
from engine.spec_eagle import EagleDecoder, shipped_head
from engine.trees import EAGLE1_TREE, StaticTree

PROMPTS = [
    "Tell me a joke about penguins.",
    "What causes the seasons on Earth?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me a recipe for a quick vegetarian dinner.",
    "Explain the difference between TCP and UDP.",
    "Who painted the Mona Lisa, and when?",
    "Write a limerick about a cat who loves coffee.",
    "How does compound interest work? Give an example with numbers.",
    "List the planets of the solar system in order from the sun.",
    "What should I pack for a weekend hiking trip?",
    "Translate 'Where is the train station?' into French.",
    "Summarize the water cycle for a school report.",
    "Write a bash one-liner that counts the lines in all .txt files.",
    "Why do cats purr?",
    "Compose a two-sentence horror story.",
    "What is the Pythagorean theorem?",
    "Suggest three names for a bakery.",
    "hi",
    "Explain what a hash table is and why lookups are fast, with a short example in JavaScript.",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
]
NEW_TOKENS = 64  # 20 prompts x 64 tokens: ~1.2k greedy decisions per method
# Small trees keep the verify forward cheap on 2 CPU cores (untrained drafts accept little, so a round costs
# about a vanilla step times the tree size); the tiny-model tests cover larger trees.
CONFIGS = {
    "sps-early-exit": ("sps", {"draft": "early-exit:10", "draft_len": 2}),
    "eagle-dynamic": ("eagle", {"head": "random", "depth": 2, "topk": 2, "tree_tokens": 3}),
    "eagle3-dynamic": ("eagle3", {"head": "random", "depth": 2, "topk": 2, "tree_tokens": 3}),
}
SMALL_STATIC = ((0,), (0, 0), (0, 1))


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    # One thread: with other jobs on the 2 cores, a second OpenMP thread mostly spins.
    llm = LLM("smollm2-135m", "float32", device="cpu", kv_cache_gb=0.25, max_batch=len(PROMPTS), threads=1,
              timing=True, weights="auto")  # the GGUF's blocks, fp32 activations
    yield llm
    torch.set_num_threads(threads)


def use(llm, method, **args):
    return llm.set_method(method, args)


def assert_released(llm, decoder):
    """Every KV block back in the pool, no sequence left running (per-sequence state goes with them)."""
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
    assert not llm.scheduler.running and not llm.scheduler.waiting


def run(llm, prompts, new_tokens=NEW_TOKENS):
    seqs, stats = llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    return [s.output_ids for s in seqs], stats.as_dict()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.chat_ids(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def vanilla(llm, prompt_ids):
    use(llm, "vanilla")
    return run(llm, prompt_ids)[0]


def assert_same(out, ref):
    for prompt, a, b in zip(PROMPTS, out, ref):
        assert a == b, prompt


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_is_lossless(llm, prompt_ids, vanilla, name):
    method, args = CONFIGS[name]
    decoder = use(llm, method, **args)
    out, stats = run(llm, prompt_ids)
    assert_same(out, vanilla)
    assert stats["rounds"] > 0 and stats["tau"] >= 1 and stats["draft_s"] > 0 and stats["verify_s"] > 0
    assert_released(llm, decoder)


@pytest.mark.slow
def test_greedy_is_lossless_static_tree(llm, prompt_ids, vanilla):
    llm.decoder = EagleDecoder(llm.runner, llm.sampler, llm.scheduler.blocks, new_head("eagle", llm.model),
                               StaticTree(SMALL_STATIC))
    llm.scheduler.lookahead = llm.decoder.lookahead
    assert_same(run(llm, prompt_ids)[0], vanilla)


def test_official_eagle1_tree_lossless(llm, prompt_ids, vanilla):
    decoder = use(llm, "eagle", head="random", tree="static")
    assert decoder.tree.verify_tokens == len(EAGLE1_TREE) + 1 == 26
    picks = [0, 17, 18]  # short, one-word and long prompts
    out, _ = run(llm, [prompt_ids[i] for i in picks], 24)
    assert out == [vanilla[i][:24] for i in picks]


def test_default_method_uses_a_shipped_eagle3_head(llm, prompt_ids, vanilla):
    if shipped_head("eagle3", llm.model.cfg) is None:
        pytest.skip("no trained EAGLE-3 head under engine/heads/")
    assert default_method() == "auto"
    decoder = use(llm, "auto")
    assert isinstance(decoder, EagleDecoder) and decoder.head.kind == "eagle3"
    out, _ = run(llm, prompt_ids[:3], 32)
    assert out == [v[:32] for v in vanilla[:3]]
    assert_released(llm, decoder)
    # auto drafts only where it pays (on this quantized target, rarely); drafting every round shows the head's
    # acceptance
    decoder = use(llm, "eagle3")
    assert decoder.head.kind == "eagle3"
    out, stats = run(llm, prompt_ids[:5], 64)
    assert out == [v[:64] for v in vanilla[:5]]
    assert stats["tau"] > 1.1  # an untrained head stays at ~1.0
    assert_released(llm, decoder)


def test_aborted_run_returns_every_block(llm, prompt_ids):
    """A callback that raises mid-run (a client gone) aborts it; both caches get all their blocks back."""
    decoder = use(llm, "eagle3", head="random", depth=2, topk=2, tree_tokens=3)

    def hang_up(seq, tokens):
        if len(seq.output_ids) > 4:
            raise ConnectionError("client gone")
    with pytest.raises(ConnectionError):
        llm.generate(prompt_ids[:3], SamplingParams(max_new_tokens=32), on_tokens=hang_up)
    assert_released(llm, decoder)


def test_batched_equals_each_request_alone(llm, prompt_ids, vanilla):
    """SpS from the target's 24th layer accepts often, so paths of different lengths mix in one batch."""
    use(llm, "sps", draft="early-exit:24", draft_len=3)
    picks = [2, 17, 18]
    batched, stats = run(llm, [prompt_ids[i] for i in picks], 32)
    assert stats["tau"] > 1.1
    for i, out in zip(picks[:2], batched):
        assert run(llm, [prompt_ids[i]], 32)[0][0] == out == vanilla[i][:32], PROMPTS[i]


def test_bad_configurations_are_clear_errors(llm, tmp_path):
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(method="medusa")
    with pytest.raises(ValueError, match="early-exit:N with 1 <= N < 30"):
        use(llm, "sps", draft="early-exit:30")
    with pytest.raises(ValueError, match="early-exit:N"):
        use(llm, "sps", draft="early-exit:two")
    with pytest.raises(ModelNotFoundError):
        use(llm, "sps", draft=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="--head not used by --method sps"):
        use(llm, "sps", head="random")
    with pytest.raises(ValueError, match="--tree must be 'dynamic' or 'static'"):
        use(llm, "eagle", head="random", tree="bushy")
    with pytest.raises(ValueError, match="--depth not used by --method eagle --tree static"):
        use(llm, "eagle", head="random", tree="static", depth=3)
    from tests.test_heads import make_head, tiny_target
    make_head("eagle3", tiny_target()).save(tmp_path / "tiny_head")
    with pytest.raises(ValueError, match="hidden size 32 .*the target has 576"):
        use(llm, "eagle3", head=str(tmp_path / "tiny_head"))
    with pytest.raises(ValueError, match="is an eagle3 head, the method needs an eagle head"):
        new_head("eagle3", llm.model).save(tmp_path / "e3")
        use(llm, "eagle", head=str(tmp_path / "e3"))
    use(llm, "vanilla")


def test_cli_reports_errors(capsys):
    assert main(["--method", "medusa", "hi"]) == 2
    assert "method must be one of" in capsys.readouterr().err


def test_bf16_greedy_is_lossless_with_the_shipped_head():
    """In bf16 every op rounds coarsely, so verification must compute what decoding computes bit for bit
    (batch-invariant linear and attention kernels); otherwise near-ties flip and outputs drift apart."""
    bf16 = LLM("smollm2-135m", "bfloat16", device="cpu", kv_cache_gb=0.25, max_batch=6, threads=1)
    prompts = [bf16.chat_ids(p) for p in PROMPTS[:6]]
    ref, _ = run(bf16, prompts, 64)
    use(bf16, "eagle3")  # the shipped head, CPU default tree
    for batch in (prompts[:1], prompts):  # alone, then six trees verified in one forward
        out, stats = run(bf16, batch, 64)
        assert out == ref[:len(batch)]
    assert stats["tau"] > 1.2
