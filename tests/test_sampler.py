"""Sampler: each option against hand-computed distributions on V=6 logits."""
import math

import pytest
import torch

from ferrum.errors import InvalidRequestError
from ferrum.layers.sampler import (Sampler, SamplingMetadata, process_logits, sampling_probs,
                                   validate_token_ids)
from ferrum.sampling_params import SamplingParams

V = 6
EOS = 5
# A distribution with distinct, easy probabilities, in shuffled order so that sorting matters.
P = [0.15, 0.40, 0.04, 0.25, 0.06, 0.10]
LOGITS = torch.tensor([math.log(p) for p in P])


def build(params, prompts=None, outputs=None, generators=None, vocab=V):
    b = len(params)
    return SamplingMetadata.build(params, prompts or [[]] * b, outputs or [[]] * b,
                                  generators or [None] * b, [EOS], vocab, "cpu")


def probs_for(**kw):
    """The final sampling distribution for LOGITS under SamplingParams(**kw)."""
    md = build([SamplingParams(**kw)])
    return sampling_probs(process_logits(LOGITS[None], md), md)[0]


def expect(weights: dict[int, float]) -> torch.Tensor:
    """Distribution over V with the given unnormalised weights, zeros elsewhere."""
    out = torch.zeros(V)
    for t, w in weights.items():
        out[t] = w
    return out / out.sum()


def test_temperature_one_is_softmax():
    torch.testing.assert_close(probs_for(), torch.tensor(P))


def test_temperature_two_flattens():
    # softmax(log p / 2) = sqrt(p) / sum sqrt(p)
    torch.testing.assert_close(probs_for(temperature=2.0),
                               expect({i: math.sqrt(p) for i, p in enumerate(P)}))


def test_top_k():
    torch.testing.assert_close(probs_for(top_k=2), expect({1: 0.40, 3: 0.25}))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # Sorted: 0.40, 0.25 (cum 0.65 < 0.7), 0.15 (cum 0.80 >= 0.7) -> three tokens.
    torch.testing.assert_close(probs_for(top_p=0.7), expect({1: 0.40, 3: 0.25, 0: 0.15}))
    # top_p below the top token's mass keeps the top token alone.
    torch.testing.assert_close(probs_for(top_p=0.1), expect({1: 1.0}))
    # also one that is 0 in float32 (it dropped every token: NaN, token 0 sampled)
    torch.testing.assert_close(probs_for(top_p=1e-50), expect({1: 1.0}))
    torch.testing.assert_close(probs_for(top_p=1e-50, top_k=3), expect({1: 1.0}))


def test_top_k_then_top_p_on_renormalised_probs():
    # top_k=3 -> [0.5, 0.3125, 0.1875]; top_p=0.6 keeps 0.5 and 0.3125 (0.8125 >= 0.6).
    torch.testing.assert_close(probs_for(top_k=3, top_p=0.6), expect({1: 0.40, 3: 0.25}))


def test_min_p():
    # Threshold 0.3 * 0.40 = 0.12: keeps 0.40, 0.25, 0.15.
    torch.testing.assert_close(probs_for(min_p=0.3), expect({1: 0.40, 3: 0.25, 0: 0.15}))


def test_min_p_filters_before_top_p_as_vllm():
    # vLLM applies min_p right after temperature, before top-k/top-p (the argmax-invariant
    # logits processors of vllm/v1/sample/sampler.py, step 7c), so top_p renormalises over
    # min_p's survivors: 0.3 * 0.40 keeps {0.40, 0.25, 0.15} -> [0.5, 0.3125, 0.1875], and
    # top_p=0.7 stops at 0.5 + 0.3125. Top-p first kept 0.15 too (0.40 + 0.25 < 0.7).
    torch.testing.assert_close(probs_for(min_p=0.3, top_p=0.7), expect({1: 0.40, 3: 0.25}))


def test_top_k_keeps_every_token_tied_with_the_kth():
    # vLLM (and HF's TopKLogitsWarper) drop the logits below the k-th largest value, so a tie
    # at the k-th place keeps all its tokens; keeping exactly k picked among them by sort order
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0, -1.0], [3.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    md = build([SamplingParams(top_k=2), SamplingParams(top_k=1, top_p=0.9)])
    torch.testing.assert_close(sampling_probs(process_logits(logits, md), md),
                               torch.stack([expect({1: 1, 2: 1, 4: 1}), expect({0: 1, 1: 1})]))


def test_greedy_is_argmax_and_skips_sampling_tensors():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    md = build([SamplingParams(temperature=0.0)] * 4, vocab=50)
    assert md.all_greedy and md.temperature is None and md.top_k is None
    assert md.seen is None and md.output_counts is None and md.logit_bias is None
    out = Sampler()(logits, md)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_tiny_temperature_is_greedy():
    md = build([SamplingParams(temperature=1e-7)])
    assert md.all_greedy
    assert Sampler()(LOGITS[None], md).token_ids.tolist() == [1]



def test_a_temperature_beyond_float32_flattens_and_keeps_masks():
    # 1e39 is inf in float32, and a masked logit (-inf, here EOS under min_tokens) / inf was
    # NaN: the softmax of the row was NaN and it sampled token 0 whatever the mask said
    md = build([SamplingParams(temperature=1e39, min_tokens=1)], outputs=[[]])
    torch.testing.assert_close(sampling_probs(process_logits(LOGITS[None], md), md)[0],
                               expect({t: 1.0 for t in range(V) if t != EOS}))


def test_mixed_batch_greedy_rows_ignore_sampling_options():
    params = [SamplingParams(temperature=0.0, top_k=3), SamplingParams(top_k=1)]
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    md = build(params)
    probs = sampling_probs(process_logits(logits, md), md)
    torch.testing.assert_close(probs, torch.stack([expect({1: 1}), expect({4: 1})]))
    for _ in range(5):
        assert Sampler()(logits, md).token_ids.tolist() == [1, 4]


def test_degenerate_distributions_always_sample_the_same_token():
    sampler = Sampler()
    for kw, token in [(dict(top_k=1), 1), (dict(top_p=0.2), 1), (dict(min_p=0.9), 1)]:
        md = build([SamplingParams(**kw)] * 8)
        assert sampler(LOGITS.expand(8, V), md).token_ids.tolist() == [token] * 8


def test_sampled_frequencies_match_distribution():
    torch.manual_seed(0)
    n = 20000
    md = build([SamplingParams(top_k=4)] * n)
    ids = Sampler()(LOGITS.expand(n, V), md).token_ids
    freq = torch.bincount(ids, minlength=V).float() / n
    want = expect({1: 0.40, 3: 0.25, 0: 0.15, 5: 0.10})
    assert freq[[2, 4]].sum() == 0
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


def vllm_reference(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, logit_bias=None,
                   repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                   prompt=(), output=()):
    """The distribution a row is sampled from by vLLM's definitions (vllm/v1/sample/sampler.py),
    in plain Python: logit_bias; repetition penalty over prompt + output (divide positive logits,
    multiply negative ones); presence / frequency over output counts; temperature; min_p against
    the max probability; top-k (logits below the k-th largest dropped); top-p over the rest,
    renormalised (the smallest prefix reaching top_p)."""
    x = [v + (logit_bias or {}).get(t, 0.0) for t, v in enumerate(logits)]
    seen = set(prompt) | set(output)
    x = [(v / repetition_penalty if v > 0 else v * repetition_penalty) if t in seen else v
         for t, v in enumerate(x)]
    x = [(v - frequency_penalty * output.count(t) - presence_penalty * (t in output)) / temperature
         for t, v in enumerate(x)]
    p = [math.exp(v - max(x)) for v in x]
    p = [v if v >= min_p * max(p) else 0.0 for v in p]
    if top_k > 0:
        kth = sorted(x, reverse=True)[top_k - 1]
        p = [v if x[t] >= kth else 0.0 for t, v in enumerate(p)]
    p = [v / sum(p) for v in p]
    keep, before = set(), 0.0
    for t in sorted(range(len(p)), key=lambda t: -p[t]):
        if before < top_p and p[t] > 0:
            keep.add(t)
        before += p[t]
    p = [v if t in keep else 0.0 for t, v in enumerate(p)]
    return [v / sum(p) for v in p]


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.3, top_p=0.75),
    dict(temperature=0.9, min_p=0.2, top_k=4, top_p=0.75),   # min_p first: top_p keeps 2, not 3
    dict(temperature=2.0),
    dict(temperature=0.8, top_p=0.9, logit_bias={2: 2.0}, repetition_penalty=1.3,
         presence_penalty=0.4, frequency_penalty=0.3, prompt=[1, 4], output=[3, 3, 0]),
])
def test_sampled_histogram_matches_vllms_distribution(kw, monkeypatch):
    """40,000 draws of one row (the batch is 40,000 copies of it, in one pass rather than 64-row
    slices) against the exact distribution by vLLM's definitions: no draw outside its support,
    and Pearson's chi-square below 30 (for at most 5 degrees of freedom, p < 2e-5 under the right
    distribution). Under a fixed seed."""
    from ferrum.layers import sampler as sampler_module
    monkeypatch.setattr(sampler_module, "SAMPLE_CHUNK_ROWS", 40_000)
    logits = [1.0, 2.5, -0.5, 2.0, 0.3, 1.7]
    prompt, output = kw.pop("prompt", []), kw.pop("output", [])
    want = vllm_reference(logits, prompt=prompt, output=output, **kw)
    n = 40_000
    md = build([SamplingParams(**kw)] * n, prompts=[prompt] * n, outputs=[output] * n)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ids = Sampler()(torch.tensor(logits).expand(n, V), md).token_ids
    counts = torch.bincount(ids, minlength=V).tolist()
    assert all(c == 0 for c, w in zip(counts, want) if w == 0), (counts, want)
    chi2 = sum((c - n * w) ** 2 / (n * w) for c, w in zip(counts, want) if w > 0)
    assert chi2 < 30, (chi2, counts, [round(n * w) for w in want])


def run_seeded(seed, others, steps=8):
    """Tokens of a seeded request (row 1 of the batch) over several steps, with `others`
    (SamplingParams) filling the rest of the batch."""
    vocab = 1000
    logits_rng = torch.Generator().manual_seed(42)
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams()] + [SamplingParams(temperature=0.8, seed=seed)] + others
    generators = [None, gen] + [torch.Generator().manual_seed(7) if p.seed else None
                                for p in others]
    tokens = []
    for _ in range(steps):
        logits = torch.randn(vocab, generator=logits_rng).expand(len(params), vocab)
        md = SamplingMetadata.build(params, [[]] * len(params), [[]] * len(params),
                                    generators, [EOS], vocab, "cpu")
        tokens.append(Sampler()(logits, md).token_ids[1].item())
    return tokens


def test_seed_reproducible_across_batch_compositions():
    alone = run_seeded(123, [])
    crowded = run_seeded(123, [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5),
                               SamplingParams(seed=9, top_k=3)])
    assert alone == crowded
    assert run_seeded(124, []) != alone


def test_logit_bias_forces_token():
    md = build([SamplingParams(temperature=0.0, logit_bias={4: 100.0}),
                SamplingParams(logit_bias={2: 100.0})])
    logits = LOGITS.expand(2, V)
    torch.testing.assert_close(process_logits(logits, md)[0, 4], LOGITS[4] + 100.0)
    assert Sampler()(logits, md).token_ids.tolist() == [4, 2]


def test_penalties_numerically():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    md = build([SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                               frequency_penalty=0.25)], prompts=[[0]], outputs=[[1, 3, 3]])
    # Repetition (prompt + output: 0, 1, 3): 2 -> 1, -1 -> -2, 3 -> 1.5.
    # Presence/frequency (output only): token 1 count 1: -0.5 - 0.25; token 3 count 2: -0.5 - 0.5.
    want = torch.tensor([[1.0, -2.75, 0.5, 0.5, -2.0, 1.0]])
    torch.testing.assert_close(process_logits(logits, md), want)



@pytest.mark.parametrize("penalty", [1e-50, 1e-40, 1e40, 1e50])
def test_extreme_repetition_penalties_keep_logits_finite(penalty):
    # 1e-50 is 0 in float32 and a seen positive logit / 1e-40 overflows: an inf logit made the
    # softmax NaN, so the row sampled token 0 and its logprobs were NaN (the server's JSON
    # then failed: a 500); 1e50 is inf in float32, and a seen logit 0 * inf was NaN
    logits = torch.tensor([[2.0, 0.0, -1.0, 3.0, -2.0, 1.0]] * 2)
    md = build([SamplingParams(repetition_penalty=penalty, temperature=1e-4, logprobs=2),
                SamplingParams(repetition_penalty=penalty, temperature=0.0, logprobs=2)],
               prompts=[[0, 1, 2]] * 2)
    processed = process_logits(logits, md)
    assert torch.isfinite(processed).all()
    probs = sampling_probs(processed, md)
    assert torch.isfinite(probs).all()
    out = Sampler()(logits, md)
    # a tiny penalty lifts the seen positive logit (token 0) above all; a huge one sinks the
    # seen ones and leaves the largest unseen (token 3) on top
    want = 0 if penalty < 1 else 3
    assert out.token_ids.tolist() == [want, want]
    assert all(math.isfinite(v) for row in out.logprobs for v in row.values())


def test_presence_frequency_ignore_prompt_and_rows_without_penalty():
    logits = torch.zeros(2, V)
    md = build([SamplingParams(frequency_penalty=1.0), SamplingParams()],
               prompts=[[2, 2], [0]], outputs=[[4, 4, 4], [4]])
    torch.testing.assert_close(process_logits(logits, md),
                               torch.tensor([[0, 0, 0, 0, -3.0, 0], [0] * 6]))


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(4, V)
    params = [SamplingParams(min_tokens=2, stop_token_ids=[3])] * 2 + [
        SamplingParams(min_tokens=2, ignore_eos=True), SamplingParams()]
    md = build(params, outputs=[[0], [0, 1], [0], [0]])
    out = process_logits(logits, md)
    inf = float("-inf")
    assert out[0].tolist() == [0, 0, 0, inf, 0, inf]      # 1 < 2 tokens: EOS and 3 masked
    assert out[1].tolist() == [0] * 6                     # min_tokens reached
    assert out[2].tolist() == [0] * 6                     # ignore_eos: EOS does not stop
    assert out[3].tolist() == [0] * 6
    md = build([SamplingParams(min_tokens=1, temperature=0.0)])
    assert Sampler()(LOGITS.clone().index_fill_(0, torch.tensor([EOS]), 50.0)[None],
                     md).token_ids.item() != EOS


def test_allowed_token_ids_keep_only_those_tokens_whatever_the_bias():
    # vLLM's allowed_token_ids: every other token -inf, after logit_bias (a bias cannot revive one)
    torch.testing.assert_close(probs_for(allowed_token_ids=[0, 3]), expect({0: 0.15, 3: 0.25}))
    md = build([SamplingParams(allowed_token_ids=[4], logit_bias={1: 100.0}), SamplingParams()])
    out = process_logits(torch.zeros(2, V), md)
    assert torch.isneginf(out[0]).tolist() == [True, True, True, True, False, True]
    assert out[1].tolist() == [0] * V                      # a row without them is untouched


def bad_words(*words, **kw) -> SamplingParams:
    p = SamplingParams(bad_words=["(set below)"], **kw)
    p.bad_words_token_ids = [list(w) for w in words]      # what the engine's tokenizer sets
    return p


def test_bad_words_ban_their_last_token_where_the_output_ends_with_the_rest():
    # words [2] (one token: always banned) and [1, 0, 3]: 3 is banned after ... 1, 0 only
    params = [bad_words([2], [1, 0, 3])] * 4
    md = build(params, outputs=[[], [1, 0], [4, 1, 0], [1, 0, 4]])
    banned = torch.isneginf(process_logits(torch.zeros(4, V), md))
    assert [row.nonzero().flatten().tolist() for row in banned] == [[2], [2, 3], [2, 3], [2]]


def test_bans_that_leave_no_token_give_way_instead_of_sampling_nan():
    # allowed_token_ids holding only the EOS while min_tokens masks it: every token -inf gave
    # NaN probabilities. min_tokens and bad_words give way first, allowed_token_ids only to a
    # grammar: the row samples the EOS (it sampled from the whole vocabulary, tokens the
    # request had excluded), and one whose allowed tokens are all bad words takes one of them
    md = build([SamplingParams(allowed_token_ids=[EOS], min_tokens=3), SamplingParams(allowed_token_ids=[EOS]),
                bad_words([1], [3], allowed_token_ids=[1, 3])])
    out = process_logits(LOGITS.repeat(3, 1), md)
    assert torch.equal(out[0], out[1]) and out[1].isneginf().sum() == V - 1
    assert out[2].isfinite().nonzero().flatten().tolist() == [1, 3]
    assert Sampler()(LOGITS.repeat(3, 1), md).token_ids[:2].tolist() == [EOS, EOS]
    # under a grammar, allowed_token_ids give way only where it allows none of them (row 0)
    md = build([SamplingParams(allowed_token_ids=[EOS], min_tokens=3)] * 2)
    md.set_grammar_bitmask([0, 1], torch.tensor([[0b000110], [0b100000]], dtype=torch.int32))
    out = process_logits(LOGITS.repeat(2, 1), md)
    assert [r.isfinite().nonzero().flatten().tolist() for r in out] == [[1, 2], [EOS]]


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 1.5}),
              SamplingParams(temperature=0.5, logprobs=0, top_k=1), SamplingParams()]
    md = build(params)
    out = Sampler()(logits, md)
    lp0 = (logits[0] + torch.tensor([1.5, 0, 0, 0, 0, 0])).log_softmax(-1)
    # Row 0: logit 0 biased to 3.5 -> greedy picks 0; top-2 = {0, 3}.
    assert out.token_ids[0].item() == 0
    assert list(out.logprobs[0]) == [0, 3]
    assert out.logprobs[0][0] == pytest.approx(lp0[0].item())
    assert out.logprobs[0][3] == pytest.approx(lp0[3].item())
    # Row 1: temperature does not change logprobs; logprobs=0 gives only the chosen token.
    assert out.logprobs[1] == {3: pytest.approx(logits[1].log_softmax(-1)[3].item())}
    assert out.logprobs[2] is None


def test_logprobs_include_chosen_token_outside_top_n():
    torch.manual_seed(0)
    logits = torch.tensor([0.1, 0, 0, 0, 0, 0]).expand(20, V)
    out = Sampler()(logits, build([SamplingParams(logprobs=1)] * 20))
    lp = logits[0].log_softmax(-1)
    chosen = out.token_ids.tolist()
    assert any(t != 0 for t in chosen)
    for t, entry in zip(chosen, out.logprobs):
        assert list(entry) == ([0] if t == 0 else [0, t])   # top-1 first, then the chosen one
        assert entry[t] == pytest.approx(lp[t].item())


def test_logprobs_carry_vllm_ranks():
    """Each value is a Logprob (a float) with vLLM's rank: a top-N entry its place in the top N,
    the chosen token outside them its 1-based rank among the vocabulary by logprob, counted
    here by sorting; a tied token ranks last among its equals (vLLM counts logprobs >= its
    own); tokens a mask rules out (-inf) are not alternatives and rank no one down."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    rows = 40
    out = Sampler()(logits.expand(rows, V), build([SamplingParams(logprobs=2)] * rows))
    lp = logits.log_softmax(-1).tolist()
    by_logprob = sorted(range(V), key=lambda t: -lp[t])           # [3, 0, 5, 2, 1, 4]
    chosen = out.token_ids.tolist()
    assert {by_logprob.index(t) for t in chosen} >= {2, 3}         # some outside the top 2
    for t, entry in zip(chosen, out.logprobs):
        assert [(k, v.rank) for k, v in entry.items()][:2] == [(3, 1), (0, 2)]
        assert entry[t].rank == by_logprob.index(t) + 1
        assert all(v.logprob == v == pytest.approx(lp[k]) and type(v.logprob) is float
                   and v.decoded_token is None for k, v in entry.items())
    # all tied: every token has V logprobs >= its own
    out = Sampler()(torch.zeros(4, V), build([SamplingParams(logprobs=0)] * 4))
    assert [e[t].rank for t, e in zip(out.token_ids.tolist(), out.logprobs)] == [V] * 4
    # min_tokens masks EOS: it is left out of the top V, whose ranks run 1..V-1
    out = Sampler()(logits[None], build([SamplingParams(logprobs=V, min_tokens=1, temperature=0)]))
    assert [(k, v.rank) for k, v in out.logprobs[0].items()] == \
        [(t, r) for r, t in enumerate([t for t in by_logprob if t != EOS], 1)]


def test_shape_mismatch_and_bad_token_ids():
    with pytest.raises(ValueError, match=r"\[1, 6\]"):
        Sampler()(torch.zeros(2, V), build([SamplingParams()]))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        validate_token_ids(SamplingParams(logit_bias={6: 1.0}), V)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        validate_token_ids(SamplingParams(stop_token_ids=[9]), V)
    validate_token_ids(SamplingParams(logit_bias={5: 1.0}, stop_token_ids=[0]), V)
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids has token ids \[6\]"):
        validate_token_ids(SamplingParams(allowed_token_ids=[1, 6]), V)
    with pytest.raises(InvalidRequestError, match=r"bad_words has token ids \[7\]"):
        validate_token_ids(bad_words([1, 7]), V)
    # a huge list is counted, not echoed (1,000,000 ids past the vocabulary made an 8 MB 400)
    with pytest.raises(InvalidRequestError) as e:
        validate_token_ids(SamplingParams(allowed_token_ids=list(range(100_000))), V)
    assert e.value.args[0] == (f"allowed_token_ids has token ids {list(range(V, V + 10))} and "
                               f"{100_000 - V - 10} more outside the vocabulary [0, {V})")


@pytest.mark.parametrize("kw, param", [
    (dict(ignore_eos="no"), "ignore_eos"), (dict(skip_special_tokens=1), "skip_special_tokens"),
    (dict(min_tokens=1.5), "min_tokens"), (dict(n=True), "n"), (dict(n=16385), "n"), (dict(max_tokens=True), "max_tokens"),
    (dict(seed=True), "seed"), (dict(logprobs=True), "logprobs"), (dict(temperature="0"), "temperature"),
    (dict(temperature=None), "temperature"), (dict(top_p=None), "top_p"), (dict(min_tokens="a"), "min_tokens"),
    (dict(stop=["\ud800"]), "stop"), (dict(stop=5), "stop"), (dict(stop={"a": 1}), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=3), "allowed_token_ids"), (dict(bad_words="no"), "bad_words"),
    (dict(bad_words=[" "]), "bad_words"), (dict(bad_words=[3]), "bad_words")])
def test_sampling_params_types_are_strict(kw, param):
    """Offline as in the server: a bool is not a count, text not a number, and stop strings are
    valid Unicode; each raises InvalidRequestError naming the parameter (some were accepted,
    others a bare TypeError). numpy scalars are numbers and come out as Python ones."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kw)
    assert info.value.param == param
    import numpy as np
    p = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(4), seed=np.int32(2))
    assert (type(p.temperature), type(p.max_tokens), type(p.seed)) == (float, int, int)


def test_logit_bias_errors_name_every_bad_key():
    """Issue 13 item 7: the error named only the first bad key."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={"7": 1.0, "abc": 1.0, "-3": 2.0, "²": 1.0, "4": 300.0, 5: float("nan")})
    msg = info.value.args[0]
    assert info.value.param == "logit_bias"
    for part in ("'abc'", "'-3'", "'²'", "300.0 for token '4'", "nan for token 5"):
        assert part in msg, msg
    assert "'7'" not in msg
    with pytest.raises(InvalidRequestError) as info:
        validate_token_ids(SamplingParams(logit_bias={"1": 1.0, "6": 1.0, "9": 1.0, "70000": 1.0}), V)
    assert "[6, 9, 70000]" in info.value.args[0] and info.value.param == "logit_bias"


def test_logit_bias_key_too_long_for_int_is_a_400():
    """A key of 5,000 digits passed the digit check, then int() raised ValueError (Python's
    4,300-digit limit): the server answered 500 "internal error: ValueError: Exceeds the limit"."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={"4" * 5000: 1.0})
    assert info.value.param == "logit_bias" and "keys must be token ids" in info.value.args[0]
    assert SamplingParams(logit_bias={"0" * 4299 + "5": 1.0}).logit_bias == {5: 1.0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_seeds_hold():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 500, generator=gen)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(top_k=20, top_p=0.9, min_p=0.05, frequency_penalty=0.5, seed=5),
              SamplingParams(logit_bias={7: 3.0}, logprobs=3),
              bad_words([9], [2, 11], allowed_token_ids=[9, 11, 12, 40], min_tokens=2)]
    outputs = [[1, 2, 2], [3, 3], [4], [2]]

    def md_on(device, rows, generators):
        return SamplingMetadata.build([params[r] for r in rows], [[0]] * len(rows),
                                      [outputs[r] for r in rows], generators, [EOS], 500, device)

    cpu, cuda = md_on("cpu", [0, 1, 2, 3], [None] * 4), md_on("cuda", [0, 1, 2, 3], [None] * 4)
    probs = sampling_probs(process_logits(logits.cuda(), cuda), cuda).cpu()
    torch.testing.assert_close(probs, sampling_probs(process_logits(logits, cpu), cpu))
    assert probs[3].nonzero().flatten().tolist() == [12, 40]   # allowed, less the bad words
    assert Sampler()(logits.cuda(), cuda).token_ids[0].item() == logits[0].argmax().item()

    def seeded_row(rows, steps=10):
        g = torch.Generator(device="cuda").manual_seed(5)
        gens = [g if r == 1 else None for r in rows]
        md = md_on("cuda", rows, gens)
        return [Sampler()(logits[rows].cuda(), md).token_ids[rows.index(1)].item()
                for _ in range(steps)]

    assert seeded_row([1]) == seeded_row([0, 2, 1]) == seeded_row([2, 1])


def test_batches_past_the_chunk_sample_in_slices_with_the_same_results(monkeypatch):
    """A batch wider than SAMPLE_CHUNK_ROWS goes through the general path in row slices
    (`SamplingMetadata.rows`): greedy and seeded rows get the tokens and logprobs of one
    batch-wide pass, with every per-row input re-indexed across slice boundaries (penalties,
    bias, min_tokens pairs, a grammar bitmask on some rows)."""
    from ferrum.layers import sampler as sampler_module
    vocab, B = 70, 11
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, vocab, generator=gen) * 3
    params = []
    for i in range(B):
        params.append(SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.7, seed=None if i % 3 == 0 else 100 + i,
            top_p=0.8 if i % 2 else 1.0, top_k=5 if i % 4 == 1 else 0, min_p=0.05 if i == 7 else 0.0,
            repetition_penalty=1.3 if i in (2, 6) else 1.0, frequency_penalty=0.4 if i == 9 else 0.0,
            logit_bias={3: 4.0} if i == 4 else None, min_tokens=5 if i in (5, 8) else 0, logprobs=3,
            allowed_token_ids=[11, 12, 13] if i == 6 else None))
    params[10] = bad_words([9], [20, 7], temperature=0.5, seed=110, logprobs=3)   # output ends with 20
    prompts = [[1, 2, 3 + i] for i in range(B)]
    outputs = [[4, EOS, 10 + i] for i in range(B)]
    bitmask = torch.zeros(3, -(-vocab // 32), dtype=torch.int32)
    for r, allowed in enumerate(([7, 8, EOS], [20, 21], [33, 64])):
        for t in allowed:
            bitmask[r, t // 32] |= 1 << (t % 32)
    results = []
    for chunk in (1000, 4):   # one pass; slices of 4 rows (boundaries at 4 and 8)
        monkeypatch.setattr(sampler_module, "SAMPLE_CHUNK_ROWS", chunk)
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        md = SamplingMetadata.build(params, prompts, outputs, gens, [EOS], vocab, "cpu")
        md.set_grammar_bitmask([3, 5, 9], bitmask)
        results.append(Sampler()(logits, md))
    whole, sliced = results
    assert torch.equal(whole.token_ids, sliced.token_ids)
    assert whole.logprobs == sliced.logprobs
    # the masks held in each slice: the grammar rows took an allowed token, min_tokens rows no EOS
    for r, allowed in zip((3, 5, 9), ([7, 8, EOS], [20, 21], [33, 64])):
        assert sliced.token_ids[r].item() in allowed
    assert EOS not in (sliced.token_ids[5].item(), sliced.token_ids[8].item())
    assert sliced.token_ids[6].item() in (11, 12, 13) and sliced.token_ids[10].item() not in (9, 7)


@pytest.mark.parametrize("big", [V, V + 1, 2**63, 10**30])
def test_top_k_above_the_vocabulary_keeps_every_token_in_a_batch_with_top_k(big):
    # vLLM takes a top_k of V or more as no top-k. ferrum put the value itself in the batch's
    # int64 top_k column once another row used top-k, and 2**63 overflowed it: the step failed
    # and every request in it with it
    md = build([SamplingParams(top_k=big), SamplingParams(top_k=2)])
    probs = sampling_probs(process_logits(torch.stack([LOGITS, LOGITS]), md), md)
    torch.testing.assert_close(probs, torch.stack([torch.tensor(P), expect({1: 0.40, 3: 0.25})]))
