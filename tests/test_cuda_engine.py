"""The engine natively on a GPU (skipped without one): every method with CUDA graphs equals the same run
without them and vanilla on the CPU, and a round's draft and verify bodies never synchronise with the host
(torch.cuda.set_sync_debug_mode("error") turns any sync into an error)."""
import contextlib
from functools import partial

import pytest
import torch

from engine.llm import LLM
from engine.scheduler import SamplingParams
from tests.conftest import write_tiny_llama
from tests.test_engine_paths import METHODS, NEW, PROMPTS, VOCAB
from tests.test_speculative_sampling import write_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cuda")
    hf = write_tiny_llama(path, seed=5, vocab_size=VOCAB, num_hidden_layers=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, VOCAB)
    return str(path)


def make(checkpoint, graphs: bool, device: str = "cuda") -> LLM:
    return LLM(checkpoint, "float32", device=device, kv_cache_gb=0.02, block_size=8, max_batch=4, seed=1,
               cuda_graphs=graphs)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Vanilla greedy on the CPU."""
    cpu = make(checkpoint, graphs=False, device="cpu")
    return [s.output_ids for s in cpu.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]]


@contextlib.contextmanager
def no_syncs():
    mode = torch.cuda.get_sync_debug_mode()  # nested guards (a step function inside a round body) keep "error"
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def guard(decoder):
    names = ["draft", "verify", "_decode", "_draft_tree_fn", "_verify_direct_fn"]  # round bodies, fused steps
    for name in ["_decode"] if type(decoder).__name__ == "VanillaDecoder" else filter(partial(hasattr, decoder), names):
        fn = getattr(decoder, name)

        def wrapped(*args, _fn=fn, **kwargs):
            with no_syncs():
                return _fn(*args, **kwargs)
        setattr(decoder, name, wrapped)


def run(llm, method, args, prompts, greedy=True, sync_free=True):
    llm.set_method(method, args)
    if sync_free:
        guard(llm.decoder)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.0 if greedy else 0.8)
    seqs, _ = llm.generate(prompts, params)
    assert llm.scheduler.blocks.num_free == llm.scheduler.blocks.num_blocks
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("name", ["vanilla"] + list(METHODS))
def test_graphs_equal_eager_and_the_cpu(checkpoint, reference, name):
    method, args = METHODS.get(name, ("vanilla", {}))
    eager = run(make(checkpoint, graphs=False), method, args, PROMPTS, sync_free=False)
    graphed_llm = make(checkpoint, graphs=True)
    run(graphed_llm, method, args, PROMPTS[:1], sync_free=False)      # captures happen on first use
    graphed = run(graphed_llm, method, args, PROMPTS)
    assert graphed == eager == reference


@pytest.mark.parametrize("name", ["vanilla", "sps", "eagle3"])
def test_sampled_rounds_are_sync_free(checkpoint, name):
    method, args = METHODS.get(name, ("vanilla", {}))
    llm = make(checkpoint, graphs=True)
    run(llm, method, args, PROMPTS[:2], greedy=False, sync_free=False)
    out = run(llm, method, args, PROMPTS[:3], greedy=False)
    assert all(len(o) == NEW for o in out)
