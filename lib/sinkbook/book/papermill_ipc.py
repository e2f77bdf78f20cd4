"""papermill, with the kernel reached over local sockets (IPC) instead of TCP.

    python -m sinkbook.book.papermill_ipc NOTEBOOK OUT [papermill's options: -p, -y, --cwd, -k, ...]

papermill's kernel manager talks to the kernel over TCP on localhost without encryption, and ipykernel (7.x)
warns about that on every start ("Kernel is running over TCP without encryption"). The warning is right about
TCP: any local user can connect to those ports. Over IPC the channels are Unix sockets beside the connection
file, in the user's Jupyter runtime directory (mode 0700), so the cause goes away rather than the message. This
module is papermill's own command line, unchanged, with one engine swapped in that asks for that transport; the
book build runs every chapter through it.
"""
from __future__ import annotations

import sys

ENGINE = "sinkbook-ipc"


def ipc_kernel_manager():
    from jupyter_client.manager import AsyncKernelManager

    class IpcKernelManager(AsyncKernelManager):
        """A kernel manager whose channels are Unix sockets (``transport="ipc"``)."""

        def __init__(self, **kwargs):
            kwargs.setdefault("transport", "ipc")
            super().__init__(**kwargs)

        async def _async_pre_start_kernel(self, **kwargs):
            # The socket paths derive from the connection file's name (``<file>-ipc-<port>``); fix that name
            # first, in the runtime directory, so no socket lands in the working directory as "kernel-ipc-*".
            if not self.connection_file:
                import uuid
                from pathlib import Path

                from jupyter_core.paths import jupyter_runtime_dir
                runtime = Path(jupyter_runtime_dir())
                runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.connection_file = str(runtime / f"kernel-{uuid.uuid4()}.json")
                self.ip = self.connection_file[:-len(".json")] + "-ipc"
            return await super()._async_pre_start_kernel(**kwargs)

    return IpcKernelManager


def register() -> None:
    """Make ``--engine sinkbook-ipc`` (and ``papermill.execute_notebook(..., engine_name=ENGINE)``) available."""
    from papermill.engines import NBClientEngine, papermill_engines

    class IpcEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            kwargs.setdefault("kernel_manager_class", ipc_kernel_manager())
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    papermill_engines.register(ENGINE, IpcEngine)


def main(argv: list[str] | None = None) -> int:
    from papermill.cli import papermill
    register()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--engine" not in argv:
        argv = ["--engine", ENGINE, *argv]
    return papermill.main(argv, prog_name="python -m sinkbook.book.papermill_ipc", standalone_mode=True)


if __name__ == "__main__":
    sys.exit(main())
