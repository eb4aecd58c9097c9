"""The capture core: one forward as CUDA graph segments with eager breaks between them, in one pool.

- `bcg.graphs.capture`: `BreakableCUDAGraph`, `BreakableCUDAGraphCapture`, `eager_on_graph`, replay tokens;
- `bcg.graphs.pool`: the pool's memory (expandable segments grown during a capture);
- `bcg.graphs.bridges`: break outputs carried from eager code into the next segment;
- `bcg.graphs.streams`: capture streams and the side streams a segment forks;
- `bcg.graphs.raw_launch`: the opt-in direct launch of a segment.

Needs only torch (and `bcg.runtime.hooks`, the torch-free registry of what bcg keeps on objects it does not
own: the ledger of a caller's capture stream); knows nothing of runners, signatures or diffusers.
"""
