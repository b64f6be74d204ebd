"""Tools that run beside the guard, not in its serving path.

Reads: nothing at import time.

Guarantees: nothing here is imported by the serving shell (``guard_trio``'s proxy, server,
engine and recorder); the dispatcher ``guard_trio.cli`` adds these subcommands to
``inference-guard``:

- ``sim-backend`` (:mod:`guard_trio.tools.sim_backend`): a simulated vLLM or SGLang server, the
  engine model of ``guard_adapters.engine_model`` behind the real servers' HTTP endpoints;
- ``simulate``: a request trace through the simulated engine under several policies, in virtual
  time and without sockets;
- ``demo``: the simulated backend, the guard and a load of simulated users in one process.
"""
