"""The demo under an ASGI server (``make live`` runs uvicorn): a run's events then come from
one hub per process, with the text of streamed turns while it comes. With DEBUG on, the static
files (the admin's, live.js) are served too, as ``runserver`` does."""

import os

from django.conf import settings
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
application = get_asgi_application()

if settings.DEBUG:
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    application = ASGIStaticFilesHandler(application)
