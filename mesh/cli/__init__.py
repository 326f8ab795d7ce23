"""``mesh``: the command line. Thin by design: parse, build settings, call a ``run_…``.

This is the only place that reads ``MESH_…`` environment variables and the only place that
configures logging. One module per kind of command (:mod:`~mesh.cli.services`,
:mod:`~mesh.cli.ops`, :mod:`~mesh.cli.log`), the parser in :mod:`~mesh.cli.parser`.
"""

from mesh.cli.log import LogFilter, cmd_log, parse_duration, parse_when
from mesh.cli.parser import build_parser, main

__all__ = ["LogFilter", "build_parser", "cmd_log", "main", "parse_duration", "parse_when"]
