"""What the commands share: the usage error, credentials from the environment, tables of
settings and states."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from dsec.addresses import check_advertise_url
from dsec.models import validation_details
from dsec.tables import format_table

DEFAULT_STATE_DIR = Path.home() / ".dsec"
DASHBOARD_HINT = (
    "http://127.0.0.1:3000/d/dsec-overview once `cd deploy && docker compose up -d` runs "
    "Grafana (deploy/README.md)"
)


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


def settings_table(model: BaseModel, heading: str) -> str:
    """A model's fields and their values (as JSON), one a row."""
    rows = [[key, json.dumps(value)] for key, value in model.model_dump().items()]
    return format_table([heading, "value"], rows)


def state_counts(counts: dict[str, int]) -> str:
    """Sandboxes by state, as a phrase: "2 leased, 3 warm" (or "none")."""
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"


def env_token(*names: str) -> str:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    raise UsageError(f"set {' or '.join(names)} (the credential for this command)")


def describe(e: ValidationError) -> str:
    return "; ".join(f"{d['loc'] or 'value'}: {d['msg']}" for d in validation_details(e))


def checked_advertise_url(
    url: str | None, scheme: str, service: str = "this service"
) -> str | None:
    """--advertise-url, checked: a URL others can dial, of the scheme `service` serves."""
    if url is None:
        return None
    try:
        url = check_advertise_url(url)
    except ValueError as e:
        raise UsageError(f"--advertise-url: {e}") from e
    if not url.startswith(f"{scheme}://"):
        raise UsageError(f"--advertise-url {url}: {service} serves {scheme}://, not that")
    return url
