"""Decode steps as captured CUDA graphs (vLLM's cudagraph_mode FULL_DECODE_ONLY).

On a GPU a decode step of a small model is bound by the host: one Qwen3.5-0.8B-shaped step dispatches ~2200 kernels,
~45 ms at ~20 us each on an H200, where its weights take 0.4 ms to read (BENCHMARKS.md, run 99). A captured graph
replays all of a step's kernels in one call.

A graph is captured per (batch bucket, block bucket): the step's decode count rounded up to the next capture size, and
the blocks of its longest context rounded up to a power of two (capped at max_model_len's). Everything the forward
reads lives in static buffers that each step overwrites in place: token ids, positions, the KV slot of each new token,
block tables, context lengths and the state slots (the decode attention's length mask, where one is needed, is made
from the context lengths inside the forward). Rows past the step's decodes (padding) read and write scratch: one KV
block and one state slot the runner allocates beyond the pools' managed ones, so they never touch a request's cache.
Graphs are captured on first use, after two warm-up passes on a side stream (torch.compile and library handles settle
there), with every row pointed at scratch so that warm-up leaves no request's cache changed; all graphs share one
memory pool (each step reads its graph's output before another replays).

Only pure decode steps take a graph (every scheduled request has one new token and a cached context); prefill and
mixed steps, batches above the largest capture size, and models whose forward reads values back to the host (MoE
routing: `decode_graph_safe = False`) run eagerly as before.

Where no CUDA device is at hand, ASCENDSERVE_DECODE_GRAPHS_EAGER=1 runs this same path with the capture left out
(each "replay" runs the forward over the static buffers): tests check the buffers, padding and scratch on a CPU.
"""

import numpy as np
import torch

from ascendserve.config import env_switch
from ascendserve.layers.attention import AttentionMetadata
from ascendserve.logger import init_logger

logger = init_logger(__name__)

EAGER_ENV = "ASCENDSERVE_DECODE_GRAPHS_EAGER"
DECODE_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # modes whose decode steps are full graphs


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The batch buckets: `sizes` (compilation_config's cudagraph_capture_sizes) up to max_num_seqs, else 1, 2, 4,
    8 and multiples of 8 up to max_num_seqs (vLLM's default list), max_num_seqs itself last either way."""
    if sizes is None:
        sizes = [1, 2, 4] + list(range(8, max_num_seqs + 1, 8))
    return sorted({s for s in sizes if 0 < s < max_num_seqs} | {max_num_seqs})


def decode_graphs_wanted(config) -> bool:
    """Whether the engine captures decode graphs: compilation_config's cudagraph_mode asks for full decode graphs,
    --enforce-eager is off, and the device is CUDA (or the eager stand-in of EAGER_ENV is on). One log line says
    why not where graphs were asked for."""
    mode = str((config.args.compilation_config or {}).get("cudagraph_mode", "NONE")).upper()
    if mode not in DECODE_MODES:
        if mode == "PIECEWISE":
            logger.warning("compilation_config cudagraph_mode PIECEWISE is not implemented: decode steps run eagerly "
                           "(FULL_DECODE_ONLY captures them)")
        return False
    if config.args.enforce_eager:
        logger.info("cudagraph_mode %s: --enforce-eager keeps every step eager", mode)
        return False
    if config.device.type != "cuda" and not env_switch(EAGER_ENV):
        logger.warning("cudagraph_mode %s: graphs need a CUDA device; on %s decode steps run eagerly", mode,
                       config.device.type)
        return False
    return True


class DecodeGraphs:
    """The static buffers, scratch rows and captured graphs of pure decode steps for one ModelRunner."""

    def __init__(self, runner, sizes: list[int], max_model_len: int, scratch_block: int,
                 scratch_state_slot: int | None) -> None:
        self.runner = runner
        self.sizes = sizes
        self.block_size = runner.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.scratch_block, self.scratch_state_slot = scratch_block, scratch_state_slot
        self.capture = runner.device.type == "cuda" and not env_switch(EAGER_ENV)
        rows, device = sizes[-1], runner.device
        long = dict(dtype=torch.long, device=device)
        # One flat buffer, [5 x rows | rows x max_blocks], and its host copy: token ids, positions, KV slots, context
        # lengths and state slots, then the block table, flat so that each bucket's [rows, blocks] table (and mask) is
        # a contiguous view of its first elements. A step writes the host copy and sends what its bucket reads in one
        # copy (before: six copies and a device-side arange).
        self._staged = torch.zeros(5 * rows + rows * self.max_blocks, **long)
        self._host = np.zeros(self._staged.numel(), dtype=np.int64)
        self.input_ids, self.positions, self.kv_slots, self.context_lens, self.state_slots = \
            self._staged[:5 * rows].view(5, rows)
        self.tables = self._staged[5 * rows:]
        self.rows = torch.arange(rows, **long)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (rows, blocks) -> (graph or None, output)
        self._pool = None
        self.num_replays = 0
        logger.info("Decode steps as %s: batch buckets %s, block buckets up to %d (captured on first use)",
                    "CUDA graphs" if self.capture else f"static-buffer replays (no capture: {EAGER_ENV})",
                    sizes, self.max_blocks)

    def bucket(self, num_rows: int, num_blocks: int) -> tuple[int, int] | None:
        """(rows, blocks) of the graph for a step, or None when it has more rows than the largest capture size."""
        rows = next((s for s in self.sizes if s >= num_rows), None)
        return None if rows is None else (rows, min(1 << (num_blocks - 1).bit_length(), self.max_blocks))

    def plan(self, sched) -> tuple[np.ndarray, tuple[int, int]] | None:
        """(context lengths, bucket) of a pure decode step that fits a graph, else None (the model runs eagerly). Reads
        only what the scheduler fixed, as ModelRunner.prepare, which then builds no eager metadata for the step."""
        scheduled = sched.scheduled
        if not all(s.num_tokens == 1 and s.start_pos > 0 for s in scheduled):
            return None
        lens = np.fromiter((s.start_pos + 1 for s in scheduled), dtype=np.int64, count=len(scheduled))
        key = self.bucket(len(scheduled), int(-(-lens.max() // self.block_size)))
        return None if key is None else (lens, key)

    def run(self, sched, token_ids: list[int], plan: tuple[np.ndarray, tuple[int, int]]) -> torch.Tensor:
        """The hidden states [decodes, hidden] of a step `plan` took, from its bucket's graph (captured on first use)."""
        scheduled, (lens, key) = sched.scheduled, plan
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        self._fill(scheduled, token_ids, lens, *key)
        graph, out = self.graphs[key]
        if graph is not None:
            graph.replay()
        else:
            out = self._forward(*key)
        self.num_replays += 1
        return out[:len(scheduled)]

    def _fill(self, scheduled, token_ids: list[int], lens: np.ndarray, rows: int, blocks: int) -> None:
        """Write the step into the static buffers: its decodes in the first rows, scratch in the rest."""
        n, bs, size = len(scheduled), self.block_size, self.sizes[-1]
        pos = lens - 1
        ids = self._host[:5 * size].reshape(5, size)  # ids, positions, kv slots, context lengths, state slots
        tables = self._host[5 * size:5 * size + rows * blocks].reshape(rows, blocks)
        tables.fill(self.scratch_block)
        for i, s in enumerate(scheduled):
            tables[i, :len(s.block_ids)] = s.block_ids[:blocks]
        ids[:, :rows] = ((0,), (0,), (self.scratch_block * bs,), (1,), (self.scratch_state_slot or 0,))
        ids[0, :n], ids[1, :n], ids[3, :n] = token_ids, pos, lens
        ids[2, :n] = tables[np.arange(n), pos // bs] * bs + pos % bs
        if self.scratch_state_slot is not None:
            ids[4, :n] = [s.state_slot for s in scheduled]
        used = 5 * size + rows * blocks  # the ids of every row (rows past the bucket unread) and the bucket's table
        self._staged[:used].copy_(torch.from_numpy(self._host[:used]))

    def _fill_scratch(self, rows: int, blocks: int) -> None:
        """Every row of a bucket on scratch (for warm-up and capture, which must change no request's cache): a step
        with no decodes."""
        self._fill([], [], np.zeros(0, dtype=np.int64), rows, blocks)

    def _forward(self, rows: int, blocks: int) -> torch.Tensor:
        """The model over a bucket's static buffers (what a graph records)."""
        runner = self.runner
        meta = AttentionMetadata(self.kv_slots[:rows], self.rows[:rows], self.tables[:rows * blocks].view(rows, blocks),
                                 self.context_lens[:rows], [])
        if runner.state_caches is None:
            return runner.model(self.input_ids[:rows], self.positions[:rows], runner.kv_caches, meta)
        from ascendserve.worker.model_runner import StateMetadata  # model_runner imports this module
        state_meta = StateMetadata(decode_token_idx=self.rows[:rows], decode_slots=self.state_slots[:rows])
        return runner.model(self.input_ids[:rows], self.positions[:rows], runner.kv_caches, meta,
                            runner.state_caches, state_meta)

    def _capture(self, rows: int, blocks: int) -> tuple:
        """(graph, its output) for a bucket; (None, None) where nothing is captured (EAGER_ENV)."""
        self._fill_scratch(rows, blocks)
        if not self.capture:
            return None, None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(rows, blocks)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the server's) do not break this thread's capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(rows, blocks)
        self._pool = graph.pool()
        logger.info("Captured the decode graph of %d rows x %d blocks", rows, blocks)
        return graph, out
