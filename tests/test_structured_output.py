"""Structured output (engine/grammar.py) on the real SmolLM2 target: under a JSON schema, a regex or a choice
every method's greedy output is vanilla's and satisfies the grammar; seeded sampled outputs satisfy it too;
a constrained request changes nothing for the unconstrained ones beside it; a complete grammar ends its
request with "stop"; bad grammars are refused before they run; every KV block comes back."""
import json
import re

import pytest
import torch

from engine.llm import LLM
from engine.scheduler import SamplingParams

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "likes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                         "student": {"type": "boolean"}},
          "required": ["name", "age", "student"]}
PHONE = r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue", "dark purple"]
CASES = {   # (kind, spec), prompt
    "json_schema": (("json", json.dumps(PERSON)), "Describe a fictional person as JSON."),
    "json_object": (("json", ""), "Reply with a JSON object giving the city and country of Paris."),
    "regex": (("regex", PHONE), "Make up a US phone number."),
    "choice": (("choice", json.dumps(COLORS)), "What color is the sky?"),
}
NEW = 64
METHODS = {
    "sps": ("sps", {"draft": "early-exit:10", "draft_len": 3}),
    "eagle": ("eagle", {}),                                                   # shipped head, the CPU's tree
    "eagle3-tree": ("eagle3", {"depth": 3, "topk": 2, "tree_tokens": 6}),
    "eagle3-chain": ("eagle3", {"depth": 3, "topk": 1, "tree_tokens": 4}),
    "auto": ("auto", {}),
}


def validate(value, schema: dict):
    """The schema keywords PERSON uses (a test's own validator: no jsonschema package here)."""
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema.get("required", ())) <= set(value), value
        props = schema.get("properties")
        if props is not None:
            assert set(value) <= set(props), value
            for k, v in value.items():
                validate(v, props[k])
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), value
        for v in value:
            validate(v, schema["items"])
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    elif kind == "boolean":
        assert isinstance(value, bool), value


def satisfies(case: str, text: str):
    if case == "json_schema":
        validate(json.loads(text), PERSON)
    elif case == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif case == "regex":
        assert re.fullmatch(PHONE, text), text
    else:
        assert text in COLORS, text


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    llm = LLM("smollm2-135m", "float32", device="cpu", kv_cache_gb=0.1, max_batch=8, threads=1,
              weights="auto")  # the GGUF's blocks, fp32 activations (as tests/test_speculative.py)
    yield llm
    torch.set_num_threads(threads)


def run(llm, structured=None, sampled=False, prompts=None):
    """Every case's prompt at once (each under its own grammar), or `prompts` under `structured`."""
    if prompts is None:
        prompts = [llm.chat_ids(p) for _, p in CASES.values()]
        structured = [s for s, _ in CASES.values()]
    params = [SamplingParams(max_new_tokens=NEW, structured=s, **({"temperature": 0.8, "top_p": 0.95, "seed": 7 + i}
                                                                    if sampled else {}))
              for i, s in enumerate(structured)]
    seqs, _ = llm.generate(prompts, params)
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks and not llm.scheduler.running
    assert all(s.grammar is None for s in seqs)  # dropped when the request retired
    return seqs


@pytest.fixture(scope="module")
def reference(llm):
    llm.set_method("vanilla")
    seqs = run(llm)
    for case, seq in zip(CASES, seqs):
        assert seq.finish_reason == "stop", (case, llm.tokenizer.decode(seq.output_ids))
        satisfies(case, llm.tokenizer.decode(seq.output_ids))
    return [s.output_ids for s in seqs]


def test_vanilla_output_satisfies_each_grammar_and_ends_there(llm, reference):
    """A complete grammar stops the request with no EOS spent (nothing else could follow)."""
    for ids in reference:
        assert llm.tokenizer.eos_token_id not in ids
    free = run(llm, [None], prompts=[llm.chat_ids(CASES["json_schema"][1])])[0]
    assert free.output_ids != reference[0]   # the grammar changed what the model says


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_is_lossless_under_grammars(llm, reference, name):
    llm.set_method(*METHODS[name])
    assert [s.output_ids for s in run(llm)] == reference


@pytest.mark.parametrize("name", ["vanilla", "sps", "eagle3-tree", "eagle3-chain"])
def test_sampled_outputs_satisfy_the_grammar(llm, name):
    """A sample either completes its grammar (and stops) or runs out of tokens part way, every token one the
    grammar took: a free JSON object can go on past NEW tokens, as a sample may (which one comes depends on the
    method's random draws, and so on the head); the phone number and the choice are shorter than NEW."""
    llm.set_method(*(METHODS[name] if name in METHODS else (name, {})))
    for case, seq in zip(CASES, run(llm, sampled=True)):
        if seq.finish_reason == "stop" or case in ("regex", "choice"):
            assert seq.finish_reason == "stop", case
            satisfies(case, llm.tokenizer.decode(seq.output_ids))
            continue
        assert seq.finish_reason == "length" and len(seq.output_ids) == NEW, case
        state = llm.grammars.state(CASES[case][0])
        assert all(state.accept(t) for t in seq.output_ids) and not state.finished, case


@pytest.mark.parametrize("topk,tokens", [(1, 4), (2, 6)], ids=["chain", "tree"])
def test_drafts_the_grammar_rejects_are_pruned(llm, reference, topk, tokens):
    """An EAGLE chain or tree is verified without its drafts the grammar rejects and what hangs under them
    (which could never be accepted): an untrained head's drafts under a phone-number regex are mostly pruned,
    and the output is still vanilla's."""
    llm.set_method("eagle3", {"head": "random", "depth": 3, "topk": topk, "tree_tokens": tokens})
    kind, prompt = CASES["regex"]
    ids = llm.chat_ids(prompt)
    sizes = []
    hook = llm.model.register_forward_hook(lambda m, args, out: sizes.append(args[0].numel()))
    try:
        out = run(llm, [kind], prompts=[ids])[0]
    finally:
        hook.remove()
    assert out.output_ids == reference[list(CASES).index("regex")]
    rounds = sizes[1:]  # after the prompt's prefill: one verify forward a round (a chain's draft is the head's)
    assert rounds and max(rounds) <= tokens and sum(n < tokens for n in rounds) > len(rounds) // 2, rounds


def test_unconstrained_requests_beside_a_grammar_are_unchanged(llm):
    llm.set_method("eagle3", METHODS["eagle3-tree"][1])
    prompts = [llm.chat_ids(p) for p in ("Why is the sky blue?", CASES["json_schema"][1], "Name a fruit.")]
    alone = [run(llm, [None], prompts=[p])[0].output_ids for p in prompts[::2]]
    mixed = run(llm, [None, CASES["json_schema"][0], None], prompts=prompts)
    assert [mixed[0].output_ids, mixed[2].output_ids] == alone
    satisfies("json_schema", llm.tokenizer.decode(mixed[1].output_ids))


def test_a_grammar_with_logit_transforms_stays_lossless(llm):
    """The grammar masks the transformed logits (penalties counting a node's drafted ancestors as output)."""
    params = SamplingParams(max_new_tokens=NEW, structured=CASES["json_schema"][0], frequency_penalty=1.0,
                            presence_penalty=0.5)
    prompt = [llm.chat_ids(CASES["json_schema"][1])]
    outputs = []
    for method, args in (("vanilla", {}), METHODS["eagle3-tree"], METHODS["sps"]):
        llm.set_method(method, args)
        seq = llm.generate(prompt, params)[0][0]
        satisfies("json_schema", llm.tokenizer.decode(seq.output_ids))
        outputs.append(seq.output_ids)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


def test_eos_ends_a_grammar_that_may_go_on_and_ignore_eos_does_not_outlive_it(llm):
    """Where the grammar may end but also go on, the model's EOS ends the request (kept as output, as without
    a grammar); with ignore_eos too, since the grammar allows nothing after it. Where it must go on, EOS is
    masked (the reference outputs end without it)."""
    llm.set_method("vanilla")
    words = "[A-Za-z ,.!']+"
    eos = llm.tokenizer.eos_token_id
    for ignore_eos in (False, True):
        params = SamplingParams(max_new_tokens=NEW, structured=("regex", words), ignore_eos=ignore_eos)
        seq = llm.generate([llm.chat_ids("Say hello.")], params)[0][0]
        assert seq.output_ids[-1] == eos and seq.finish_reason == "stop"
        assert re.fullmatch(words, llm.tokenizer.decode(seq.output_ids[:-1]))
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks


@pytest.mark.parametrize("structured,match", [
    (("json", '{"type": "foo"}'), "invalid json: Unsupported type"),
    (("json", "{not json"), "invalid json"),
    (("json", '{"type": "object", "properties": 5}'), "invalid json"),
    (("regex", "(ab"), "invalid regex: .*parenthesis"),
    (("grammar", 'root ::= "a" |'), "invalid grammar"),
    (("grammar", "start: nope"), "invalid grammar"),
    (("choice", "[]"), "invalid choice"),
    (("choice", '["a", 3]'), "invalid choice"),
    (("yaml", "a: 1"), "kind must be one of"),
])
def test_bad_grammars_are_refused_before_they_run(llm, structured, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, structured=structured))
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, min_tokens=2, structured=("regex", "a+")))
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks and not llm.has_work


def test_lark_and_ebnf_grammars(llm):
    llm.set_method("vanilla")
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'
    for grammar in (ebnf, lark):
        seq = run(llm, [("grammar", grammar)], prompts=[llm.chat_ids("What is 6 times 7?")])[0]
        assert re.fullmatch(r"The answer is [0-9]+\.", llm.tokenizer.decode(seq.output_ids)), seq.output_ids


def test_tree_nodes_are_masked_by_the_state_after_their_drafted_ancestors(llm):
    """Sampler.constrain on a hand-made tree under the regex a(b|c)d: root -> "a" -> "b" -> "d", and a sibling
    "x" the grammar rejects (its own row then decides nothing: all allowed). A node's row allows what may
    follow it; the rejected draft gets -inf in its parent's row, so verification never accepts it."""
    from engine.scheduler import Sequence
    from engine.trees import Tree
    tok = llm.tokenizer
    a, b, c, d, x = (tok.convert_tokens_to_ids(ch) for ch in "abcdx")
    seq = Sequence([1, 2], SamplingParams(structured=("regex", "a(b|c)d")))
    seq.grammar = llm.grammars.state(seq.params.structured)
    V = llm.cfg.vocab_size
    # nodes: 0 root (an output token the grammar has not seen: roots are already taken), 1 "a", 2 "x", 3 "b"
    # under "a", 4 "d" under "b", 5 padding
    tree = Tree(torch.tensor([[7, a, x, b, d, 0]]), torch.tensor([[-1, 0, 0, 1, 3, -1]], dtype=torch.int32),
                torch.tensor([[0, 1, 1, 2, 3, 0]], dtype=torch.int32), torch.zeros(1, 6),
                torch.tensor([5], dtype=torch.int32))
    out = llm.sampler.constrain(torch.zeros(1, 6, V), [seq], tree)[0]
    allowed = [set((row == 0).nonzero().flatten().tolist()) for row in out]
    assert a in allowed[0] and x not in allowed[0] and b not in allowed[0]
    assert {b, c} <= allowed[1] and a not in allowed[1] and d not in allowed[1]
    assert len(allowed[2]) == V and len(allowed[5]) == V          # rejected draft, padding: undecided
    assert d in allowed[3] and b not in allowed[3]
    assert allowed[4] == {tok.eos_token_id}                       # complete: only the end
    out = llm.sampler.constrain(torch.zeros(1, V), [seq])         # a decode step: the root's row
    assert set((out[0] == 0).nonzero().flatten().tolist()) == allowed[0]
    assert seq.grammar.accept(a) and not seq.grammar.accept(x) and seq.grammar.accept(b)  # the walk left no trace
