"""The jobs side: Job records, the REST submit API and the Celery integration."""
