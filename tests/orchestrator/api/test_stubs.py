"""The committed modules in kvresume/v1 are exactly what the pinned generator makes of proto/, and the
proto keeps its naming convention (every enum value prefixed with its enum's name)."""

from __future__ import annotations

from pathlib import Path

from proto.generate import PROTO_FILES, STUBS_DIR, generate_stubs


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    fresh = generate_stubs(tmp_path)
    assert len(fresh) == 3 * len(PROTO_FILES)
    committed = {p.name: p.read_bytes() for p in STUBS_DIR.glob("*_pb2*") if p.is_file()}
    stale = sorted(n for n in fresh if committed.get(n) != fresh[n])
    extra = sorted(set(committed) - set(fresh))
    assert not stale and not extra, (
        f"kvresume/v1 is out of date ({stale or extra}): run `python -m proto.generate` and commit"
    )


def test_enum_values_carry_their_enum_prefix() -> None:
    import re

    from orchestrator.api import load_stubs

    stubs = load_stubs()
    for module in (stubs.common, stubs.sessions, stubs.admin, stubs.mappers, stubs.models):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum.name).upper() + "_"
            for value in enum.values:
                assert value.name.startswith(prefix), f"{enum.name}.{value.name} lacks prefix {prefix}"
            assert enum.values[0].name == prefix + "UNSPECIFIED" and enum.values[0].number == 0
