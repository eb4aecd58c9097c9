"""The runner: a module's calls, keyed by input signature, replayed from captured graphs or run eagerly.

- `bcg.runtime.runner`: `BreakableGraphRunner` (decides eager / replay / capture per call);
- `bcg.runtime.signature`: `Signature`, `signature_of`, `call_context`;
- `bcg.runtime.entries`: the signature-keyed cache of captures;
- `bcg.runtime.recorder`: how a runner captures (on the capture stream, in the shared pool);
- `bcg.runtime.config`: `RunnerConfig` (the runner's settings), `TransformerOptions` (what `accelerate`
  does to a transformer), their ``BCG_*`` environment variables;
- `bcg.runtime.hooks`: `HookRegistry`, the one registry per object of everything bcg installs;
- `bcg.runtime.compile`: compiled segments (`RunnerConfig(compile=True)`);
- `bcg.runtime.quantize` / `bcg.runtime.weights_store`: float8 linears, and a quantized state stored once
  and reloaded as it is;

Builds on `bcg.graphs`; knows nothing of diffusers.
"""
