"""NGRAM proposer: longest-suffix matching, breadth-first trees by frequency then recency,
padding to N, bounded memory, thread safety and bad inputs."""
import threading

import pytest
import torch

import specdec_inductor
from specdec_inductor import ops
from specdec_inductor.proposers.ngram import NgramProposer


def _drafts(draft, b=0):
    """Real draft tokens of request b as {node: (parent, token)}."""
    n = draft.tokens.shape[1]
    mask = draft.tree_mask.view(-1, n, n)[b]
    out = {}
    for i in range(1, 1 + int(draft.num_drafts[b])):
        parent = max(j for j in range(i) if mask[i, j])
        out[i] = (parent, int(draft.tokens[b, i]))
    return out


def test_repetition_gives_the_continuation_chain():
    p = NgramProposer(num_draft_tokens=4, breadth=(1,))
    p.add_request(0, [10, 11, 12, 13, 14, 10, 11])
    d = p.propose([0], torch.tensor([7]))
    assert d.tokens.tolist() == [[11, 12, 13, 14]]
    assert int(d.num_drafts[0]) == 3
    assert d.positions.tolist() == [7, 8, 9, 10]
    assert d.retrieve_next_token.tolist() == [[1, 2, 3, -1]]


def test_longest_suffix_wins_over_shorter_match():
    # "5" alone was followed by 6 most often, but "4 5" was followed by 9.
    p = NgramProposer(num_draft_tokens=2, max_window=3, breadth=(1,))
    p.add_request(1, [5, 6, 5, 6, 5, 6, 4, 5, 9, 1, 4, 5])
    assert p.propose([1], torch.tensor([12])).tokens.tolist() == [[5, 9]]
    q = NgramProposer(num_draft_tokens=2, max_window=1, breadth=(1,), confident_window=1)
    q.add_request(1, [5, 6, 5, 6, 5, 6, 4, 5, 9, 1, 4, 5])
    assert q.propose([1], torch.tensor([12])).tokens.tolist() == [[5, 6]]


def test_tree_is_breadth_first_by_frequency_then_recency():
    p = NgramProposer(num_draft_tokens=6, max_window=1, breadth=(3, 1), confident_window=1)
    # After 7: 8 twice, 9 once (most recent), 3 once (older).
    p.add_request(2, [7, 3, 0, 7, 8, 1, 7, 8, 2, 7, 9, 4, 7])
    d = p.propose([2], torch.tensor([13]))
    nodes = _drafts(d)
    assert [nodes[i] for i in (1, 2, 3)] == [(0, 8), (0, 9), (0, 3)]  # level 1: count, then recency
    assert nodes[4] == (1, 2) and nodes[5] == (2, 4)  # level 2, breadth 1: most recent child
    # The mask is a valid ancestor mask: linkage agrees.
    assert d.retrieve_next_token[0, 0] == 1 and d.retrieve_next_sibling[0, 1] == 2


def test_no_match_pads_with_root_children_and_batches_mix():
    p = NgramProposer(num_draft_tokens=5, confident_window=1)
    p.add_request(3, [1, 2, 3])  # nothing repeats
    p.add_request(4, [1, 2, 1])
    d = p.propose([3, 4], torch.tensor([3, 3], dtype=torch.int32))
    assert d.num_drafts.tolist() == [0, 2]
    assert d.tokens.tolist() == [[3, 3, 3, 3, 3], [1, 2, 1, 1, 1]]  # "1 2 1" continues "1" then "1 2"
    mask = d.tree_mask.view(2, 5, 5)
    assert mask[0].int().tolist() == torch.eye(5, dtype=torch.int).index_fill(1, torch.tensor([0]), 1).tolist()
    assert d.positions.tolist() == [3, 4, 4, 4, 4, 3, 4, 5, 4, 4]
    again = ops.reconstruct_tree_from_mask(d.tree_mask, torch.tensor([3, 3]), 5)
    assert torch.equal(again[0], d.positions)


def test_short_matches_offer_one_draft_and_the_index_reports_match_length():
    """A draft continuing a suffix shorter than confident_window offers its first node only
    (the loop then verifies 2 tokens, a plain decode step's cost); the tree itself is the same."""
    context = [7, 8, 1, 7, 8, 2, 5, 7]  # "7" recurs (1-token match); "5 7" never did
    short = NgramProposer(num_draft_tokens=4, breadth=(2, 1))
    trusting = NgramProposer(num_draft_tokens=4, breadth=(2, 1), confident_window=1)
    for p in (short, trusting):
        p.add_request(0, context)
    a, b = short.propose([0], torch.tensor([8])), trusting.propose([0], torch.tensor([8]))
    assert int(a.num_drafts[0]) == 1 and int(b.num_drafts[0]) == 3
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tree_mask, b.tree_mask)
    short.append(0, [8])  # now "7 8" (2 tokens) matches: the full draft comes back
    assert int(short.propose([0], torch.tensor([9])).num_drafts[0]) == 3
    tokens, mask, num_drafts, match_len = short._index.propose([0], 4, [2, 1])
    assert match_len.tolist() == [2] and match_len.dtype == torch.int32
    short.add_request(1, [1, 2, 3])
    assert short._index.propose([1], 4, [1])[3].tolist() == [0]  # no match


def test_append_extends_context_and_remove_frees():
    p = NgramProposer(num_draft_tokens=3, breadth=(1,))
    p.add_request(5, [1, 2, 3, 4])
    p.append(5, [1, 2])
    assert p.propose([5], torch.tensor([6])).tokens.tolist() == [[2, 3, 4]]
    p.remove_request(5)
    assert p.num_requests() == 0


def test_memory_is_bounded_and_recent_context_still_matches():
    p = NgramProposer(num_draft_tokens=4, max_window=3, breadth=(1,), max_nodes_per_request=4096)
    gen = torch.Generator().manual_seed(0)
    p.add_request(6, torch.randint(0, 30000, (20000,), generator=gen).tolist())
    assert p.num_trie_nodes(6) <= 4096
    p.append(6, [1, 2, 3, 4, 5, 1, 2])
    assert p.num_trie_nodes(6) <= 4096
    assert p.propose([6], torch.tensor([0])).tokens.tolist()[0][:3] == [2, 3, 4]


def test_concurrent_appends_and_proposals():
    p = NgramProposer(num_draft_tokens=8)
    for rid in range(4):
        p.add_request(rid, [rid, 1, 2, 3])
    errors = []

    def work(rid):
        try:
            for step in range(300):
                p.append(rid % 4, [step % 7, 1, 2])
                d = p.propose([0, 1, 2, 3], torch.zeros(4, dtype=torch.int64))
                assert d.tokens.shape == (4, 8)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_ngram_bad_inputs():
    with pytest.raises(ValueError, match="max_window"):
        NgramProposer(num_draft_tokens=4, min_window=3, max_window=2)
    with pytest.raises(ValueError, match="max_nodes_per_request"):
        NgramProposer(num_draft_tokens=4, max_nodes_per_request=10)
    with pytest.raises(ValueError, match="confident_window"):
        NgramProposer(num_draft_tokens=4, confident_window=0)
    p = NgramProposer(num_draft_tokens=4)
    with pytest.raises(IndexError, match="request_id"):
        p.propose([9], torch.tensor([0]))
    p.add_request(9, [])
    with pytest.raises(ValueError, match="no tokens"):
        p.propose([9], torch.tensor([0]))
    with pytest.raises(ValueError, match="already present"):
        p.add_request(9, [1])
    with pytest.raises(IndexError, match="request_id"):
        p.remove_request(10)
    q = NgramProposer(num_draft_tokens=4, breadth=(0,))
    q.add_request(0, [1])
    with pytest.raises(ValueError, match="breadth"):
        q.propose([0], torch.tensor([0]))


def test_ngram_path_is_counted():
    specdec_inductor.reset_kernel_path_counts()
    p = NgramProposer(num_draft_tokens=4)
    p.add_request(0, [1, 2, 1])
    p.propose([0], torch.tensor([3]))
    assert specdec_inductor.kernel_path_counts()["ngram_propose:portable"] == 1


def test_min_window_skips_one_token_matches():
    # Only the last token (7) recurs: a 1-token window drafts its continuation, 2 does not.
    ctx = [7, 8, 9, 1, 2, 7]
    one = NgramProposer(num_draft_tokens=3, min_window=1, max_window=8, breadth=(1,))
    one.add_request(0, ctx)
    assert one.propose([0], torch.tensor([6])).tokens.tolist() == [[7, 8, 9]]
    two = NgramProposer(num_draft_tokens=3, min_window=2, max_window=8, breadth=(1,))
    two.add_request(0, ctx)
    assert int(two.propose([0], torch.tensor([6])).num_drafts[0]) == 0
    two.append(0, [8])  # now "7 8" recurs
    assert two.propose([0], torch.tensor([7])).tokens.tolist() == [[8, 9, 1]]


@pytest.mark.parametrize("text", ["2", "a,b", "3,2", "0,4", "1,2,3"])
def test_parse_window_names_the_argument(text):
    from specdec_inductor.proposers.ngram import parse_window
    with pytest.raises(ValueError, match="argument 'ngram_window'"):
        parse_window(text)
