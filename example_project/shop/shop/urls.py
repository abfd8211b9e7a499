"""The shop's URLs: Django's admin (orders, and celery-delayed's pending jobs, dead letters and schedules)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
