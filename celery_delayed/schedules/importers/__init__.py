"""Import recurring schedules from redbeat or django-celery-beat (``delayed schedules import``).

One module per source (:mod:`.redbeat`, :mod:`.django_celery_beat`), each
reading, disabling and re-reading the old entries with that package's own
code, imported only when the command runs; :mod:`.entry` holds what is read
and where an imported schedule resumes; :mod:`.run` plans the import and
hands each entry over (its docstring says how nothing runs twice or is
skipped at the switch).
"""

from __future__ import annotations

from .run import Imported, NotImported, Report, import_schedules

__all__ = ["Imported", "NotImported", "Report", "import_schedules"]
