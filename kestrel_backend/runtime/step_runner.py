"""The forwards of a step, which run the model: a flat forward over whole prompts (and, in a mixed step, the
running sequences' inputs and prefixes prefilled ahead), through a prefill graph or eagerly; the decode forward
(CUDA graphs on a GPU), and the decode step launched ahead of the host reading its inputs. A part of the Scheduler
(see scheduler.py)."""

from __future__ import annotations

import numpy as np
import torch

from ..model.layers import to_device
from ..model.lora import LoraRows
from .admission import PrefixAhead
from .attention import SeqSlice
from .sequence import Sequence

# Prefill steps that run eagerly (longer than the prefill graphs, or with adapters) are padded to a multiple of this
# many rows, and every such row count past the graphs' longest up to the step budget runs once at start-up
# (warm_eager_prefill): the first step of a row count paid per-shape work on the host (such as cuBLAS choosing its
# kernels for new matrix shapes; no Triton kernel compiled then): 10 ms a step more for Moondream 2 on an H100, 15 to
# 250 for Moondream 3, which held up a server's first burst by 9 to 17%.
EAGER_PAD = 256


class RowsOf:
    """Some rows of a step's tokens on their way to the host (tolist() -> those rows' tokens, in this order)."""

    def __init__(self, tokens, rows: list[int]):
        self.tokens, self.rows = tokens, rows

    def tolist(self) -> list[int]:
        every = self.tokens.tolist()
        return [every[row] for row in self.rows]


class StepRunner:
    def _inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """This step's input embedding of each running sequence: a token's, or a region head's."""
        m = self.model
        ids = [seq.next_input if isinstance(seq.next_input, int) else 0 for seq in seqs]
        x = m.embed_tokens(ids)
        for i, seq in enumerate(seqs):
            if not isinstance(seq.next_input, int):
                x[i] = seq.next_input.reshape(-1)
        return x

    def _decode(self, seqs: list[Sequence], launch_ahead: bool = False):
        """-> (logits, hidden, greedy tokens when the step chose them already, or None). launch_ahead:
        the next step will decode the same sequences, if none finishes."""
        if self.decoder is None:
            return *self.forward_flat([], seqs), None
        ids, positions = [s.id for s in seqs], [s.length for s in seqs]
        choices = [s.generation.choice() for s in seqs]
        banned = [c.banned for c in choices]
        rows, outputs = self.launched_ahead(seqs, ids, positions, banned)
        if outputs is not None:
            logits, hidden, greedy = outputs  # launched last step, with these inputs (and maybe rows since ended)
            self.steps_ahead["used"] += 1
        else:
            slots = [s.adapter.slot if s.adapter is not None else 0 for s in seqs]
            logits, hidden, greedy = self.decoder.run([s.next_input for s in seqs], ids, positions, banned, slots)
        for seq in seqs:
            seq.length += 1
        positions = [s.length for s in seqs]
        if launch_ahead and greedy is not None and rows is None and self.may_launch_ahead(seqs, choices):
            self._launch_ahead(ids, positions, banned)  # (while the GPU runs this step)
        else:
            self.decoder.prepare(ids, positions)  # stage the next step's rows while the GPU runs this one
        return logits, hidden, greedy

    def launched_ahead(self, seqs: list[Sequence], ids, positions, banned):
        """The decode step launched last step, if it computed these sequences' inputs: -> (None, its outputs) if it
        holds exactly them, (their rows in it, their outputs) if it also holds rows that have ended since (ended by
        a stop token, cancelled: their tokens are dropped, their cache writes land in pages they give back), else
        (None, None): it is dropped (its writes land in slots that this step rewrites)."""
        ahead, self.step_ahead = self.step_ahead, None
        if ahead is None:
            return None, None
        held = {seq_id: (row, pos, ban) for row, (seq_id, pos, ban) in enumerate(zip(*ahead[:3]))}
        rows = [held.get(seq_id, (None,))[0] for seq_id in ids]
        if None in rows or any(held[i][1:] != (p, b) for i, p, b in zip(ids, positions, banned)) or not all(
                isinstance(s.next_input, int) and s.next_input == self.chosen.get(s.id) for s in seqs):
            self.steps_ahead["dropped"] += 1
            return None, None
        logits, hidden, greedy = ahead[3]
        if rows == list(range(len(ahead[0]))):
            return None, (logits, hidden, greedy)
        index = to_device(rows, torch.long, logits.device)
        return rows, (logits.index_select(0, index), hidden.index_select(0, index), RowsOf(greedy, rows))

    def _launch_ahead(self, ids: list[int], positions: list[int], banned: list[tuple[int, ...]]) -> None:
        """Launch a decode step of these sequences before the host has read their inputs, the tokens the GPU's last
        step chose (fed back on the GPU): the next step uses it if the guess holds, else drops it."""
        self.step_ahead = (ids, positions, banned, self.decoder.run([self.decoder.FED_BACK] * len(ids), ids, positions,
                                                                banned))

    def may_launch_ahead(self, seqs: list[Sequence], choices) -> bool:
        """Whether to launch the next decode step of seqs (all the sequences it will hold) now: its inputs are
        predictable, and no waiting request could take a free slot in it (admit holds requests back while a step
        launched ahead is in flight: one step, as none is launched again while they wait)."""
        room = self.waiting and len(seqs) < self.max_batch_size
        return not room and self.predictable(seqs, choices)

    def may_launch_first_decode(self, new: list[Sequence], decoding: list[Sequence]) -> bool:
        """Whether the sequences this step prefilled alone (not mixed) have their first decode step launched now,
        behind their prefill, taking its tokens on the GPU: when the next step decodes exactly them (every running
        sequence takes its last token in this step, no waiting request could take a free slot), and their inputs
        are predictable (greedy text, no adapter). At one slot that is every request: the GPU would otherwise wait
        for the host to read the prefill's token and launch the step (the image encoded ahead fills that wait for
        every second request only)."""
        if any(s.generation.may_continue_after_next_token() for s in decoding) or any(
                s.adapter is not None for s in new):
            return False
        return self.may_launch_ahead(new, [s.generation.choice() for s in new])

    def _launch_first_decode(self, new: list[Sequence], tokens) -> None:
        """Launch the decode step after the prefill of `new` ahead, its inputs the prefill's chosen tokens (still on
        the GPU: TokensToHost)."""
        self.decoder.feed_back(tokens.on_device)
        self._launch_ahead([s.id for s in new], [s.length for s in new],
                           [s.generation.banned_after_next_token() for s in new])

    @staticmethod
    def predictable(seqs: list[Sequence], choices) -> bool:
        """Whether the next step's inputs are this step's tokens, with the same bans: every sequence
        generates text greedily and has room for another token, which its max_tokens allows (one ending with this
        step's token leaves the next step, which would drop a step launched ahead: for a direct answer of 3 tokens,
        one step in 3)."""
        return all(s.generation.feeds_back_tokens and c.temperature == 0 and s.length < s.capacity
                   and s.generation.may_continue_after_next_token() for s, c in zip(seqs, choices))

    def forward_flat(self, prefilling: list[Sequence], decoding: list[Sequence] = (),
                      ahead: list[PrefixAhead] = ()):
        """One forward over a flat token list through self.attention: the whole prompts of `prefilling` (from the
        first position not in the cache yet), then one input of each of `decoding`, then the image prefixes of
        `ahead`. -> (logits, last hidden) of each sequence of prefilling and decoding, in that order."""
        m, pieces = self.model, []
        for seq in prefilling:
            x = m.embed_prompt(seq.token_ids, seq.prompt_overrides)
            pieces.append((torch.cat([seq.next_input, x], dim=0) if seq.prefix_len else x)[seq.length:])
        if decoding:
            pieces += list(self._inputs(decoding)[:, None, :])
        pieces += [a.inputs for a in ahead]
        seqs, prefill = list(prefilling) + list(decoding), bool(prefilling or ahead)
        spans = [(s.id, s.length, s.prefix_len, s.blocks) for s in seqs] + [(a.id, 0, a.prefix_len, ()) for a in ahead]
        positions = to_device(np.concatenate([np.arange(first, first + len(x)) for (_, first, _, _), x in
                                              zip(spans, pieces)]), torch.long, m.device)  # (one copy a step)
        slices, start = [], 0
        for (seq_id, first, prefix_len, blocks), x in zip(spans, pieces):
            blocks = tuple(b for b in blocks if b[1] > first)  # (those this step's rows still write)
            slices.append(SeqSlice(seq_id, start, start + len(x), first, prefix_len, positions[start:start + len(x)],
                                   blocks))
            start += len(x)
        for seq, x in zip(seqs, pieces):
            seq.length += len(x)
        x = torch.cat(pieces)
        lora = LoraRows.of([s.adapter for s in seqs] + [None] * len(ahead), [len(p) for p in pieces])
        blocks = any(s.blocks for s in slices)  # (later image blocks: the torch attention's general mask takes them)
        graphs = self.prefill_graphs
        if prefill and graphs is not None and (lora is None or graphs.takes_adapters) and not blocks and \
                graphs.fits([len(p) for p in pieces]):
            slots = None if lora is None else [s.adapter.slot if s.adapter else 0 for s in seqs] + [0] * len(ahead)
            logits, hidden = graphs.run(x, slices, slots)
            return logits[:len(seqs)], hidden[:len(seqs)]
        pad = -x.shape[0] % self.eager_pad if prefill and self.eager_pad else 0
        if pad:  # (padded rows: computed, neither stored nor attended to, dropped; no adapter's span covers them)
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        attention = self.block_attention if blocks else self.attention
        attention.plan(slices)
        hidden = m.forward(x, positions, attention, lora)
        last = hidden.index_select(0, to_device([s.end - 1 for s in slices[:len(seqs)]], torch.long, hidden.device))
        return m.logits(last), last

    def warm_eager_prefill(self, up_to: int) -> None:
        """Run an eager prefill step of every padded row count from past the prefill graphs' longest to up_to (at
        most what the free KV pages hold) once, now, not under the first requests (see EAGER_PAD). Its sequences
        are placeholders whose pages go back at once."""
        if not self.eager_pad:
            return
        m, longest = self.model, self.prefill_graphs.max_rows if self.prefill_graphs is not None else 0
        up_to = min(up_to, self.cache.pages_free * self.cache.page_size)
        with torch.inference_mode():
            for rows in range(longest + self.eager_pad, up_to + 1, self.eager_pad):
                ids = range(-1, -1 - -(-rows // 1024), -1)  # (ids no request has) of up to 1024 rows each
                slices, start = [], 0
                for seq_id in ids:
                    n = min(1024, rows - start)
                    self.cache.allocate(seq_id, n)
                    positions = torch.arange(n, device=m.device)
                    slices.append(SeqSlice(seq_id, start, start + n, 0, 0, positions))
                    start += n
                try:
                    self.attention.plan(slices)
                    x = torch.randn(rows, m.config.text.dim, device=m.device, dtype=m.dtype)  # (spread over experts)
                    m.forward(x, torch.cat([s.positions for s in slices]), self.attention)
                finally:
                    for seq_id in ids:
                        self.cache.free(seq_id)
