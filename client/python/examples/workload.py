"""A serving loop for the examples and the CI model test: chunked prefill of prompts of
different lengths, then greedy decoding with continuous batching (sequences join while others
decode, and leave when they have their tokens), every step's attention served by attnd.

Model-agnostic: the caller gives `forward(step, token_ids, positions)` (one step's new tokens,
in plan-entry order, whose attention goes through `step`) returning logits [T, vocab], and
`reference(tokens)` (the same model run alone over a whole sequence) returning logits
[len(tokens), vocab]. No transformers import here: the CI test (tests/python) uses it with a
plain-torch model.
"""
import dataclasses
import time

import numpy as np


@dataclasses.dataclass
class Sequence:
    sequence_id: int
    prompt: list
    max_new_tokens: int
    arrival_step: int = 0           # the serving step at which it joins
    tokens: list = None             # prompt + generated
    fed: int = 0                    # tokens whose k/v attnd holds
    logits: dict = None             # position -> logits row attnd's run produced there

    def __post_init__(self):
        self.tokens = list(self.prompt)
        self.logits = {}

    @property
    def generated(self):
        return len(self.tokens) - len(self.prompt)

    @property
    def finished(self):
        return self.generated >= self.max_new_tokens


@dataclasses.dataclass
class RunStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    max_batch: int = 0

    @property
    def tokens_per_second(self):
        return (self.prefill_tokens + self.decode_tokens) / max(self.seconds, 1e-9)

    @property
    def decode_tokens_per_second(self):
        return self.decode_tokens / max(self.seconds, 1e-9)


def serve(begin_step, forward, sequences, prefill_chunk=16, free=None, max_steps=10_000):
    """Runs every sequence to its max_new_tokens. begin_step(entries) opens a Step (a context
    manager) for [(sequence_id, num_new_tokens)]; free(ids) releases finished sequences."""
    stats = RunStats()
    active, waiting = [], sorted(sequences, key=lambda s: s.arrival_step)
    start = time.perf_counter()
    for step_index in range(max_steps):
        while waiting and waiting[0].arrival_step <= step_index:
            active.append(waiting.pop(0))
        if not active and not waiting:
            break
        if not active:
            continue
        entries, token_ids, positions = [], [], []
        for sequence in active:
            remaining_prompt = len(sequence.prompt) - sequence.fed
            count = min(prefill_chunk, remaining_prompt) if remaining_prompt > 0 else 1
            new = sequence.tokens[sequence.fed:sequence.fed + count]
            entries.append((sequence.sequence_id, count))
            token_ids.extend(new)
            positions.extend(range(sequence.fed, sequence.fed + count))
            if remaining_prompt > 0:
                stats.prefill_tokens += count
            else:
                stats.decode_tokens += count
        stats.max_batch = max(stats.max_batch, len(entries))
        with begin_step(entries) as step:
            logits = np.asarray(forward(step, token_ids, positions), dtype=np.float32)
        stats.steps += 1
        row = 0
        for sequence, (_, count) in zip(active, entries):
            for offset in range(count):
                sequence.logits[sequence.fed + offset] = logits[row + offset]
            sequence.fed += count
            row += count
            if sequence.fed == len(sequence.tokens):  # prompt done or decoded: next token
                sequence.tokens.append(int(np.argmax(logits[row - 1])))
        finished = [s for s in active if s.finished]
        if finished and free is not None:
            free([s.sequence_id for s in finished])
        active = [s for s in active if not s.finished]
    stats.seconds = time.perf_counter() - start
    return stats


@dataclasses.dataclass
class Comparison:
    max_abs_logit_error: float = 0.0
    logit_scale: float = 0.0
    positions: int = 0
    greedy_mismatches: list = dataclasses.field(default_factory=list)
    # Greedy choices that differ where the reference's top two logits are closer than twice the
    # position's own logit error: a tie the dtype's rounding may break either way.
    near_ties: list = dataclasses.field(default_factory=list)


def compare(sequences, reference):
    """Logits of the served run against `reference` over each sequence's final tokens, at every
    position the served run produced, and its greedy choices against the reference's."""
    result = Comparison()
    for sequence in sequences:
        expected = np.asarray(reference(sequence.tokens[:-1]), dtype=np.float32)
        for position, logits in sequence.logits.items():
            error = float(np.max(np.abs(logits - expected[position])))
            result.max_abs_logit_error = max(result.max_abs_logit_error, error)
            result.logit_scale = max(result.logit_scale, float(np.max(np.abs(expected[position]))))
            result.positions += 1
            if position >= len(sequence.prompt) - 1:
                chosen = sequence.tokens[position + 1]
                if int(np.argmax(expected[position])) != chosen:
                    top = np.sort(expected[position])[-2:]
                    margin = float(top[1] - top[0])
                    where = (sequence.sequence_id, position)
                    (result.near_ties if margin <= 2 * error else
                     result.greedy_mismatches).append(where)
    return result


def make_sequences(vocab_size, prompt_lengths, max_new_tokens, arrivals, seed=0):
    rng = np.random.default_rng(seed)
    return [Sequence(sequence_id=100 + i, prompt=rng.integers(0, vocab_size, length).tolist(),
                     max_new_tokens=new, arrival_step=arrival)
            for i, (length, new, arrival) in enumerate(zip(prompt_lengths, max_new_tokens,
                                                            arrivals))]
