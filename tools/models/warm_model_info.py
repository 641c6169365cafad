# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""Fill vLLM's model-info cache for the architectures of some checkpoints.

    python tools/models/warm_model_info.py build/models

Before vLLM builds a model it inspects the architecture's class (is it MoE,
does it support LoRA, ...) in a fresh `python -m vllm.model_executor.models.registry`
subprocess, so that importing the model cannot initialize CUDA in the server,
and caches the answer under $VLLM_CACHE_ROOT/modelinfos, keyed by a hash of the
model's source file. On a cold cache (every CI run: a fresh clone) that is one
vLLM import per architecture, ~15 s of CPU apiece on the CI VMs, eleven times.
Here the same inspection runs for all of them in this one process (there is no
CUDA to keep clean on the CPU flavor) and vLLM's own code writes the cache
entries; the engines then find them. Only a speed-up: an architecture that
fails here is inspected by vLLM as usual.
"""

import json
import sys
from pathlib import Path


def architectures(models_dir: Path) -> list[str]:
    return sorted({arch for config in models_dir.glob("*/config.json")
                   for arch in json.loads(config.read_text()).get("architectures", [])})


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    from vllm.model_executor.models import registry

    # The inspection vLLM would run in a subprocess, run here: the function
    # handed to _run_in_subprocess is self-contained (it imports the model
    # module and reads the class's attributes).
    registry._run_in_subprocess = lambda fn: fn()
    archs = architectures(Path(sys.argv[1]))
    missing = [arch for arch in archs
               if registry.ModelRegistry._try_inspect_model_cls(arch) is None]
    print(f"model info cached for {len(archs) - len(missing)} architectures"
          + (f"; not inspected: {', '.join(missing)}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
