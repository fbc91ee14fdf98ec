"""Distillation divergences against closed forms and their defining properties."""

import pytest
import torch

from draftsmith.train.losses import distill_loss, top1_agreement


def logits(seed, n=5, v=7):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 2


def test_divergences_match_their_definitions():
    s, t = logits(0), logits(1)
    p, q = t.softmax(-1), s.softmax(-1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1).mean()  # noqa: E731
    torch.testing.assert_close(distill_loss("fkl", s, teacher_logits=t), kl(p, q))
    torch.testing.assert_close(distill_loss("rkl", s, teacher_logits=t), kl(q, p))
    m = 0.3 * p + 0.7 * q
    torch.testing.assert_close(distill_loss("jsd", s, teacher_logits=t, beta=0.3), 0.3 * kl(p, m) + 0.7 * kl(q, m))
    torch.testing.assert_close(distill_loss("tv", s, teacher_logits=t), 0.5 * (p - q).abs().sum(-1).mean())
    labels = torch.tensor([0, 1, 2, 3, 4])
    torch.testing.assert_close(distill_loss("ce", s, labels=labels), -q.log()[range(5), labels].mean())


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tv"])
def test_zero_at_equality_positive_otherwise(kind):
    t = logits(2)
    assert distill_loss(kind, t.clone(), teacher_logits=t).abs() < 1e-6
    assert distill_loss(kind, logits(3), teacher_logits=t) > 1e-3


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tv"])
def test_teacher_probabilities_equal_teacher_logits(kind):
    s, t = logits(4), logits(5)
    from_logits = distill_loss(kind, s, teacher_logits=t, temperature=2.0)
    from_probs = distill_loss(kind, s, teacher_probs=t.softmax(-1), temperature=2.0)
    torch.testing.assert_close(from_logits, from_probs, rtol=1e-4, atol=1e-5)


def test_gradients_flow_and_empty_batches_are_zero():
    s = logits(6).requires_grad_()
    distill_loss("fkl", s, teacher_logits=logits(7)).backward()
    assert s.grad.abs().sum() > 0
    empty = torch.zeros(0, 7, requires_grad=True)
    loss = distill_loss("jsd", empty, teacher_logits=torch.zeros(0, 7))
    assert loss.item() == 0.0
    loss.backward()


def test_top1_agreement():
    s = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert top1_agreement(s, torch.tensor([1, 1])).item() == 0.5


def test_draft_vocabulary_ranks_answer_tokens_then_prompt_tokens_then_low_ids():
    import datasets

    from draftsmith.train.data_prep import draft_vocabulary

    rows = datasets.Dataset.from_list([
        {"input_ids": [9, 9, 9, 4, 4, 7], "loss_mask": [0, 0, 0, 1, 1, 1]},  # 9 is in prompts only
        {"input_ids": [9, 5, 4, 5, 5, 8], "loss_mask": [0, 1, 1, 1, 1, 0]},
    ])
    assert draft_vocabulary(rows, 2, 12).tolist() == [4, 5]  # 4 and 5 three times each, then 7
    assert draft_vocabulary(rows, 3, 12).tolist() == [4, 5, 7]
    # the answers name three tokens: the prompts' 9 (four times) and 8 come next, then the lowest ids
    assert draft_vocabulary(rows, 8, 12).tolist() == [4, 5, 7, 9, 8, 0, 1, 2]
    assert draft_vocabulary(rows, 100, 12).tolist() == [4, 5, 7, 9, 8, 0, 1, 2, 3, 6, 10, 11]  # the whole vocabulary
    assert draft_vocabulary(rows, 8, 12, fill=False).tolist() == [4, 5, 7]  # the answers' tokens only
    assert draft_vocabulary(rows, 2, 12, fill=False).tolist() == [4, 5]


def test_draft_vocabulary_losses_equal_the_full_vocabulary_ones_on_its_tokens():
    """Training over the K draft tokens only: cross-entropy equals the full one where the drafter's
    logits are -inf outside the vocabulary (as it drafts), labels outside are ignored, and the offline
    teacher is renormalised over the K tokens as the online teacher's softmax is."""
    from draftsmith.speculative.eagle import to_draft_vocab, vocab_slots

    vocab = torch.tensor([1, 3, 4, 6])
    assert vocab_slots(vocab, torch.tensor([3, 0, 6, 7, 1])).tolist() == [1, -100, 3, -100, 0]
    s, t = logits(8), logits(9)
    masked = torch.full_like(s, float("-inf"))
    masked[:, vocab] = s[:, vocab]
    labels = torch.tensor([3, 6, 1, 4, 3])
    torch.testing.assert_close(distill_loss("ce", s[:, vocab], labels=vocab_slots(vocab, labels)),
                               distill_loss("ce", masked, labels=labels))
    mixed = vocab_slots(vocab, torch.tensor([3, 0, 0, 4, 2]))  # three labels no draft could match
    torch.testing.assert_close(distill_loss("ce", s[:, vocab], labels=mixed),
                               distill_loss("ce", masked[[0, 3]], labels=torch.tensor([3, 4])))
    assert distill_loss("ce", s[:, vocab], labels=torch.full((5,), -100)).item() == 0.0  # all outside: no NaN
    online, _ = to_draft_vocab(vocab, t, None)
    _, offline = to_draft_vocab(vocab, None, t.softmax(-1))
    for kind in ("fkl", "jsd", "tv"):
        torch.testing.assert_close(distill_loss(kind, s[:, vocab], teacher_logits=online),
                                   distill_loss(kind, s[:, vocab], teacher_probs=offline), rtol=1e-4, atol=1e-5)
