"""Running gpuguard: the composition root (`root`: build and run the agent with its server), the loop
(`agent`), /healthz, /readyz and /metrics (`server`, `health`), and what the one-shot `check` reads of its
node (`checknode`, `gpucount`). It wires the stages below it and decides nothing itself."""
