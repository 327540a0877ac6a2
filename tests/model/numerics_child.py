"""A fresh process for the numerics-profile tests: `python -m tests.model.numerics_child MODE DIR CPU_PATH`.

It enters the CPU path itself before torch loads (as `kvresume` does), so the test starts it with no
profile variables in its environment. Modes:
- write: prefill a history on a seeded v41-tiny, save its global KV and window bytes, then continue the
  in-memory state (new tokens, greedy decode steps) and save those logits: the uninterrupted run.
- read: restore the state from the saved bytes (a full hit) and run the same continuation; prints JSON
  with whether the logits equal the writer's bit for bit, or the cache-format error (a miss).
- threads: the same prefill and decode at 1 and at 2 intra-op threads; prints whether the exports and
  logits are byte-identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.numerics_env import enter_cpu_path, profile_report

HISTORY, NEW, STEPS = 150, 20, 3


def main(argv: list[str]) -> int:
    mode, folder, cpu_path = argv[0], Path(argv[1]), argv[2]
    rc = enter_cpu_path(cpu_path, argv, module="tests.model.numerics_child")
    if rc is not None:
        return rc
    import torch
    from safetensors.torch import load_file, save_file

    from model import (
        CacheFormatError,
        NumericsProfile,
        Transformer,
        configure_torch,
        decode,
        export_global,
        export_windows,
        import_windows,
        init_random,
        load_preset,
        model_fingerprint,
        prefill,
        state_from_global,
    )

    configure_torch(cpu_path, threads=1)
    model = init_random(Transformer(load_preset("v41-tiny")), seed=5).eval()
    fp = model_fingerprint(model, numerics=NumericsProfile(cpu_path=cpu_path))
    tokens = torch.randint(0, 512, (1, HISTORY + NEW), generator=torch.Generator().manual_seed(11))

    def continuation(state) -> torch.Tensor:
        rows = [prefill(model, tokens[:, HISTORY:], state, mode="ced").logits]
        for _ in range(STEPS):
            rows.append(decode(model, rows[-1].argmax(-1), state).logits)
        return torch.cat(rows)

    report: dict[str, object] = {"numerics": profile_report(cpu_path)}
    with torch.inference_mode():
        if mode == "write":
            state = prefill(model, tokens[:, :HISTORY], mode="ced").state
            (folder / "global.bin").write_bytes(export_global(state, 0, HISTORY, fingerprint=fp))
            (folder / "windows.bin").write_bytes(export_windows(model, state, fingerprint=fp))
            save_file({"logits": continuation(state)}, str(folder / "uninterrupted.safetensors"))
        elif mode == "read":
            try:
                state = state_from_global(
                    model, tokens[:, :HISTORY], [(folder / "global.bin").read_bytes()], fingerprint=fp
                )
                import_windows(model, state, (folder / "windows.bin").read_bytes(), fingerprint=fp)
            except CacheFormatError as exc:
                report["miss"] = str(exc)
            else:
                want = load_file(str(folder / "uninterrupted.safetensors"))["logits"]
                report["bitwise"] = bool(torch.equal(continuation(state), want))
        elif mode == "threads":
            digests = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                state = prefill(model, tokens, mode="ced").state
                blob = export_global(state, 0, state.n_tokens, fingerprint=fp) + export_windows(
                    model, state, fingerprint=fp
                )
                digests.append((blob, continuation(prefill(model, tokens[:, :HISTORY], mode="ced").state)))
            report["identical"] = digests[0][0] == digests[1][0] and torch.equal(digests[0][1], digests[1][1])
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
