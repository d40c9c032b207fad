"""Logging: plain text for people, one JSON object per line for machines (`--log-format json`),
and a handler that puts log records on the event bus for `/v1/events` and the TUI."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from metrale.telemetry import events
from metrale.telemetry.bus import EventBus

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMAT_ENV = "METRALE_LOG_FORMAT"  # passed on to the engine-core process
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", ...}`; an access-log record adds its fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            entry.update(access)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def write_output_to(log_file: Path) -> None:
    """This process's standard output and error appended to `log_file` (a child process of a
    server whose terminal belongs to the dashboard)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def configure(level: str = "info", log_format: str | None = None) -> None:
    """Set up the root logger for this process (and, through the environment, its children)."""
    log_format = log_format or os.environ.get(FORMAT_ENV, "text")
    if log_format not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, not {log_format!r}")
    os.environ[FORMAT_ENV] = log_format
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class EventLogHandler(logging.Handler):
    """Publishes records at INFO and above as `Log` events, only while someone listens."""

    def __init__(self, bus: EventBus, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.bus = bus

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "metrale.access" or not self.bus.has_subscribers:
            return  # an access line per request is what request.finished already says
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in someone's log call
            message = str(record.msg)
        self.bus.publish(
            events.Log(level=record.levelname.lower(), logger=record.name, message=message)
        )
