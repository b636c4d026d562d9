"""The adapters a run's rows may run with (--adapter, --adapters, a row's folder) and whose is whose."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...core.errors import RowError, short
from ...core.files import adapter_config, row_path
from ...core.settings import BASE_ADAPTER, GenerationSettings

__all__ = ["AdapterSet"]


@dataclass(slots=True)
class AdapterSet:
    """The run's adapters, as folders: `run` for rows that name none, `named` by the names rows
    give, and folders rows name relative to the job's (`job_dir`; None: a remote job, whose
    rows name the set only), inside `media_root` as a media path must be. `fuse`: each adapter
    fused into the weights as it is applied (--fuse-adapters)."""

    run: str | None = None
    named: dict[str, str] = field(default_factory=dict)
    fuse: bool = False
    job_dir: Path | None = None
    media_root: str | None = None
    _folders: dict[str, str | RowError] = field(default_factory=dict)  # each folder rows named, checked once

    @classmethod
    def of(cls, settings: GenerationSettings) -> AdapterSet:
        s = settings
        return cls(s.adapter, dict(s.adapters), s.fuse_adapters, s.job_dir, s.media_root)

    @property
    def any(self) -> bool:
        """Whether the run's rows name adapters from a set, or all run with one."""
        return self.run is not None or bool(self.named)

    def folder_of(self, name: str | None) -> tuple[str | None, bool]:
        """The folder of the adapter a row naming `name` runs with (None: the model as it is),
        and whether the row named it by its folder rather than from the run's set."""
        if name is None:
            return self.run, False
        if name == BASE_ADAPTER:
            return None, False
        if name in self.named:
            return self.named[name], False
        return self._folder(name), True

    def _folder(self, name: str) -> str:
        """A row's adapter named by its folder, once it is one batchgen can apply (a `read`
        RowError naming the set when it is not)."""
        if name not in self._folders:
            try:
                folder = row_path(name, self.job_dir, self.media_root)
                adapter_config(folder)
                self._folders[name] = str(folder.resolve())
            except (OSError, ValueError, RuntimeError) as e:  # refused, missing, not an adapter, a loop
                known = ", ".join(sorted(self.named)) or "none given"
                why = f"not one of --adapters ({known}) nor {BASE_ADAPTER!r}, nor an adapter folder"
                self._folders[name] = RowError("read", f"adapter {name!r}: {why} ({short(e, 300)})")
        found = self._folders[name]
        if isinstance(found, RowError):
            raise RowError(found.stage, str(found))
        return found
