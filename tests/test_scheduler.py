import pytest

from engine.scheduler import SamplingParams, Scheduler, Sequence, cached_len


def make(num_blocks=8, block_size=4, max_batch=4, ctx=64, lookahead=0):
    return Scheduler(num_blocks, block_size, max_batch, ctx, eos_ids=(2,), lookahead=lookahead)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make().add(Sequence([5, 6], SamplingParams(**kwargs)))


def test_prompt_longer_than_context_is_rejected():
    with pytest.raises(ValueError, match="context"):
        make(ctx=16).add(Sequence(list(range(16)), SamplingParams()))


def test_request_larger_than_pool_is_rejected():
    with pytest.raises(ValueError, match="KV blocks"):
        make(num_blocks=2).add(Sequence([1] * 6, SamplingParams(max_new_tokens=8)))


def test_admission_reserves_worst_case_and_batch_limit():
    s = make(num_blocks=8, block_size=4, max_batch=2, lookahead=4)
    reqs = [Sequence([1] * 4, SamplingParams(max_new_tokens=8)) for _ in range(3)]  # 16 tokens = 4 blocks
    for r in reqs:
        s.add(r)
    assert s.admit() == reqs[:2] and s.admit() == []
    reqs[0].finish_reason = "stop"
    s.blocks.allocate(reqs[0].seq_id, 5)
    assert s.retire_finished() == [reqs[0]] and s.blocks.num_free == 8
    assert s.admit() == [reqs[2]]


def test_stops_at_eos_and_max_tokens():
    s = make()
    a = Sequence([1], SamplingParams(max_new_tokens=10))
    b = Sequence([1], SamplingParams(max_new_tokens=3))
    assert s.append_tokens(a, [5, 2, 7]) == [5, 2] and a.finish_reason == "stop"
    assert s.append_tokens(b, [5, 6, 7, 8]) == [5, 6, 7] and b.finish_reason == "length"
    c = Sequence([1], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert s.append_tokens(c, [2, 2]) == [2, 2] and not c.finished


def test_abort_frees_blocks():
    s = make()
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=4))
    s.add(seq)
    s.admit()
    s.blocks.allocate(seq.seq_id, 3)
    s.abort_all()
    assert s.blocks.num_free == 8 and not s.has_work


def test_prepare_reserves_the_lookahead_and_commit_cuts_back_to_the_cache_invariant():
    s = make(num_blocks=8, block_size=4, lookahead=5)
    seq = Sequence([1, 2, 3], SamplingParams(max_new_tokens=10, ignore_eos=True))
    s.add(seq)
    s.admit()
    s.prepare([seq], [len(seq.prompt_ids)])
    assert s.blocks.length(seq.seq_id) == 3 + 5
    s.commit(seq, [7])
    assert s.blocks.length(seq.seq_id) == cached_len(seq) == 3 and s.blocks.num_free == 7
    s.prepare([seq])
    assert s.blocks.length(seq.seq_id) == 3 + 5 and s.blocks.num_free == 6
    assert s.commit(seq, [8, 9, 10]) == [8, 9, 10]
    assert s.blocks.length(seq.seq_id) == cached_len(seq) == 6 and s.blocks.num_free == 6
    s.commit(seq, [1] * 8)  # finishes at max_new_tokens: retirement frees it
    assert seq.finish_reason == "length" and s.retire_finished() == [seq] and s.blocks.num_free == 8


def test_token_views_match_all_ids():
    """last_id, num_tokens and span read a sequence's tokens without building all_ids; they must agree with it
    on every range, across the prompt / output boundary and past the end."""
    seq = Sequence([10, 11, 12, 13], SamplingParams())
    for step in range(4):
        ids = seq.all_ids
        assert seq.last_id == ids[-1] and seq.num_tokens == len(ids)
        for a in range(len(ids) + 2):
            for b in range(a, len(ids) + 3):
                assert seq.span(a, b) == ids[a:b], (step, a, b)
        seq.output_ids.append(20 + step)
