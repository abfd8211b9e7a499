"""Orders in the admin, each with a link to its reminder's job (celery-delayed's admin)."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.urls import reverse
from django.utils.html import format_html

from orders.models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("id", "customer", "amount_cents", "paid", "reminder")

    @admin.display(description="reminder")
    def reminder(self, order: Order) -> str:
        if not order.reminder_job:
            return "-"
        url = reverse("admin:celery_delayed_pendingjob_change", args=[quote(order.reminder_job)])
        return format_html('<a href="{}">{}</a>', url, order.reminder_job)
