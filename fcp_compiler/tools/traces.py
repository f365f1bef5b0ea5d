"""Batch generators: draw sequence lengths until a batch holds exactly a given number of tokens.

All draws use numpy's PCG64 generator with an explicit seed, so a (generator, parameters, seed) triple gives the
same batch on every machine.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import numpy as np

from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.inputs import MAX_BATCH_TOKENS
from fcp_compiler.format.safe_io import parse_json, read_input_text

_DRAW_CHUNK = 4096


def _generator(seed: int) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise InvalidInputError(f"seed {seed!r} must be an integer from 0 to 2^63 - 1")
    return np.random.default_rng(seed)


def _fill(draw, total_tokens: int) -> list[int]:
    """Draw lengths in chunks until their sum reaches total_tokens; cut the last one to fit exactly."""
    if not 1 <= total_tokens <= MAX_BATCH_TOKENS:
        raise InvalidInputError(f"total tokens {total_tokens} must be from 1 to {MAX_BATCH_TOKENS} (what a batch may "
                                f"hold)")
    lengths: list[int] = []
    filled = 0
    while filled < total_tokens:
        chunk = draw(_DRAW_CHUNK)
        cumulative = filled + np.cumsum(chunk)
        stop = int(np.searchsorted(cumulative, total_tokens, side="left"))
        if stop < chunk.size:
            lengths.extend(int(x) for x in chunk[:stop])
            lengths.append(int(total_tokens - (cumulative[stop - 1] if stop else filled)))
            return lengths
        lengths.extend(int(x) for x in chunk)
        filled = int(cumulative[-1])
    return lengths


def lognormal_batch(total_tokens: int, median: float, sigma: float, min_len: int, max_len: int,
                    seed: int) -> list[int]:
    """Lognormal lengths (by median and sigma) clipped to [min_len, max_len], filled to exactly total_tokens.

    Raises:
        InvalidInputError: non-positive median, negative sigma, or min_len > max_len.
    """
    if not (np.isfinite(median) and np.isfinite(sigma)) or median <= 0 or sigma < 0:
        raise InvalidInputError(f"lognormal needs median > 0 and sigma >= 0, got median={median}, sigma={sigma}")
    if not 1 <= min_len <= max_len:
        raise InvalidInputError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = _generator(seed)

    def draw(count: int) -> np.ndarray:
        values = rng.lognormal(mean=np.log(median), sigma=sigma, size=count)
        return np.clip(np.rint(values), min_len, max_len).astype(np.int64)

    return _fill(draw, total_tokens)


def empirical_batch(values: np.ndarray, total_tokens: int, seed: int, max_len: int | None = None,
                    tail_fraction: float = 0.0, tail_min: int = 131072, tail_max: int = 524288) -> list[int]:
    """Lengths drawn with replacement from observed values (optionally clipped), filled to exactly total_tokens.

    With tail_fraction > 0, that share of the tokens first goes to long sequences drawn log-uniformly in
    [tail_min, tail_max] (a long tail added to a short-dominated distribution); the sequences are then shuffled.
    """
    _check_tail(tail_fraction, tail_min, tail_max)
    values = np.asarray(values, dtype=np.int64)
    values = values[values > 0]
    if values.size == 0:
        raise InvalidInputError("the length file holds no positive lengths")
    if max_len is not None and max_len < 1:
        raise InvalidInputError(f"max length {max_len} must be >= 1")
    if max_len is not None:
        values = np.minimum(values, max_len)
    rng = _generator(seed)
    return _with_tail(rng, lambda count: values[rng.integers(0, values.size, size=count)], total_tokens,
                      tail_fraction, tail_min, tail_max)


def _check_tail(tail_fraction: float, tail_min: int, tail_max: int) -> None:
    if not 0.0 <= tail_fraction < 1.0 or not 1 <= tail_min <= tail_max:
        raise InvalidInputError(f"tail fraction {tail_fraction} must be in [0, 1) and 1 <= tail_min {tail_min} "
                                f"<= tail_max {tail_max}")


def _with_tail(rng: np.random.Generator, draw, total_tokens: int, tail_fraction: float, tail_min: int,
               tail_max: int) -> list[int]:
    """Fill total_tokens from `draw`, after a share tail_fraction of them went to long sequences drawn
    log-uniformly in [tail_min, tail_max]; with a tail, the sequences are then shuffled."""
    tail_tokens = int(total_tokens * tail_fraction)
    tail = []
    if tail_tokens:
        log_lo, log_hi = np.log(tail_min), np.log(tail_max)
        tail = _fill(lambda count: np.floor(np.exp(rng.uniform(log_lo, log_hi, size=count))).astype(np.int64),
                     tail_tokens)
    rest = _fill(draw, total_tokens - tail_tokens) if total_tokens > tail_tokens else []
    lengths = tail + rest
    return [lengths[i] for i in rng.permutation(len(lengths)).tolist()] if tail else lengths


def histogram_batch(bin_edges: np.ndarray, counts: np.ndarray, total_tokens: int, seed: int,
                    tail_fraction: float = 0.0, tail_min: int = 131072, tail_max: int = 524288) -> list[int]:
    """Lengths from a histogram: a bin by its count, then a length log-uniform inside [low, high).

    Args:
        bin_edges: num_bins + 1 increasing positive edges.
        counts: num_bins non-negative counts.
        tail_fraction, tail_min, tail_max: an added long tail, as in :func:`empirical_batch`.
    """
    _check_tail(tail_fraction, tail_min, tail_max)
    bin_edges = np.asarray(bin_edges, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    if bin_edges.size != counts.size + 1 or (np.diff(bin_edges) <= 0).any() or bin_edges[0] < 1:
        raise InvalidInputError(f"histogram edges must be increasing and >= 1 with one more edge than counts, "
                                f"got {bin_edges.size} edges for {counts.size} counts")
    if counts.sum() <= 0 or (counts < 0).any():
        raise InvalidInputError("histogram counts must be non-negative with a positive sum")
    rng = _generator(seed)
    probabilities = counts / counts.sum()
    log_edges = np.log(bin_edges)

    def draw(count: int) -> np.ndarray:
        bins = rng.choice(counts.size, size=count, p=probabilities)
        log_len = rng.uniform(log_edges[bins], log_edges[bins + 1])
        return np.maximum(np.floor(np.exp(log_len)), 1).astype(np.int64)

    return _with_tail(rng, draw, total_tokens, tail_fraction, tail_min, tail_max)


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Read lengths from a JSON list, a text file of one length per line, or a CSV (first numeric column).

    Raises:
        InvalidInputError: missing file or no lengths in it.
    """
    path = Path(path)
    text = read_input_text(path, "length")
    try:
        if path.suffix == ".json":
            data = parse_json(text, f"length file {str(path)!r}")
            data = data["sequences"] if isinstance(data, dict) else data
            return np.asarray(data, dtype=np.int64)
        return np.asarray([int(float(line.split(",")[0])) for line in text.split() if line.strip()], dtype=np.int64)
    except (ValueError, TypeError, KeyError, OverflowError, json.JSONDecodeError) as error:
        raise InvalidInputError(f"length file {str(path)!r} is not a list of lengths: {error}") from None


def read_histogram_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a histogram CSV with columns (low, high, count) or a range label like "4096-8192" and a count.

    Raises:
        InvalidInputError: missing file or rows that are not bins.
    """
    path = Path(path)
    text = read_input_text(path, "histogram")
    lows, highs, counts = [], [], []
    for row in csv.reader(io.StringIO(text, newline="")):
        cells = [cell.strip() for cell in row if cell.strip()]
        # Either "low,high,count,..." or a range label "[low, high]" (inclusive) then "count,...".
        label_numbers = re.findall(r"\d+(?:\.\d+)?", cells[0]) if cells else []
        try:
            if len(label_numbers) == 2 and len(cells) >= 2:
                low, high, count = float(label_numbers[0]), float(label_numbers[1]) + 1, float(cells[1])
            elif len(cells) >= 3:
                low, high, count = float(cells[0]), float(cells[1]), float(cells[2])
            else:
                continue
        except ValueError:
            continue  # header or comment line
        if not all(np.isfinite((low, high, count))) or count < 0 or high <= low:
            raise InvalidInputError(f"histogram file {str(path)!r}: bin {row!r} must have finite low < high and a "
                                    f"count >= 0")
        lows.append(max(low, 1.0))
        highs.append(high)
        counts.append(count)
    if not counts:
        raise InvalidInputError(f"histogram file {str(path)!r} has no (low, high, count) rows")
    edges = np.array(lows + [highs[-1]], dtype=np.float64)
    return edges, np.array(counts, dtype=np.float64)


# The longest sequence a trace draws (the seed's 512K), unless the spec says otherwise.
MAX_TRACE_LENGTH = 524288


def parse_trace_spec(spec: str, tokens_per_gpu: int):
    """A batch for any GPU count from a trace spec (the --trace-spec of fcp compare and fcp sweep).

    Args:
        spec: ``lognormal:MEDIAN:SIGMA:MAXLEN[:SEED]`` (docs/DESIGN.md section 8, shortest sequence 64 tokens) or
            ``file:PATH:TAIL_FRACTION[:SEED]`` (lengths drawn from a file, up to MAX_TRACE_LENGTH, with that share of
            tokens in a 128K-512K tail).
        tokens_per_gpu: tokens a GPU holds (weak scaling).
    Returns:
        a function from the number of GPUs to a list of lengths holding exactly gpus x tokens_per_gpu tokens.
    Raises:
        InvalidInputError: a spec of neither form (quoted), or an unreadable lengths file.
    """
    parts = spec.split(":")
    try:
        if parts[0] == "lognormal" and len(parts) in (4, 5):
            median, sigma, max_len = float(parts[1]), float(parts[2]), int(parts[3])
            seed = int(parts[4]) if len(parts) == 5 else 0
            return lambda gpus: lognormal_batch(gpus * tokens_per_gpu, median, sigma, 64, max_len, seed)
        if parts[0] == "file" and len(parts) in (3, 4):
            values, tail = read_lengths_file(parts[1]), float(parts[2])
            seed = int(parts[3]) if len(parts) == 4 else 0
            return lambda gpus: empirical_batch(values, gpus * tokens_per_gpu, seed, MAX_TRACE_LENGTH, tail)
    except ValueError:
        pass
    raise InvalidInputError(f"--trace-spec {spec!r} must be lognormal:MEDIAN:SIGMA:MAXLEN[:SEED] or "
                            f"file:PATH:TAIL_FRACTION[:SEED]")
