"""An order."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    amount_cents = models.IntegerField()
    paid = models.BooleanField(default=False)
    reminder_job = models.CharField(max_length=64, blank=True, default="")
