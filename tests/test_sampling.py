import torch

from kestrel_backend.skills.sampling import Choice, choose_tokens


def test_greedy_and_bans():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    assert choose_tokens(logits.clone(), [Choice(), Choice()]) == [1, 0]
    assert choose_tokens(logits.clone(), [Choice(banned=(1,)), Choice(banned=(0, 1))]) == [2, 2]


def test_greedy_chosen_by_the_step_is_taken_and_sampled_rows_still_sample():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    greedy = torch.tensor([2, 1], dtype=torch.int32)  # what a GPU step with bans would have chosen
    assert choose_tokens(logits.clone(), [Choice(), Choice()], greedy) == [2, 1]
    hot = Choice(temperature=1.0, seed=3)
    assert choose_tokens(logits.clone(), [Choice(), hot], greedy)[1] == choose_tokens(logits.clone(), [Choice(), hot])[1]
    assert greedy.tolist() == [2, 1]  # the step's buffer is left as it was


def test_seeded_draws_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    row = torch.randn(1, 1000)
    c = Choice(temperature=1.0, top_p=1.0, seed=42, step=3)
    alone = choose_tokens(row.clone(), [c])[0]
    others = torch.randn(5, 1000)
    batched = choose_tokens(torch.cat([others[:2], row, others[2:]]),
                            [Choice(temperature=0.7, seed=i) for i in range(2)] + [c] + [Choice()] * 3)
    assert batched[2] == alone


def test_sampling_follows_the_distribution_and_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    choices = [Choice(temperature=1.0, top_p=1.0, seed=7, step=i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(choose_tokens(logits.clone(), choices)), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts
    nucleus = [Choice(temperature=1.0, top_p=0.7, seed=7, step=i) for i in range(4000)]
    got = torch.tensor(choose_tokens(logits.clone(), nucleus))
    assert set(got.tolist()) == {0, 1}  # 0.5 < 0.7, so the token crossing 0.7 (0.3) stays in; the rest are cut
    share = (got == 0).float().mean()
    assert abs(share - 0.5 / 0.8) < 0.03
