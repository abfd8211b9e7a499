"""Placing an order: the order and its reminder commit together, or neither exists."""

from __future__ import annotations

from django.db import transaction

from orders.models import Order
from orders.tasks import remind_unpaid


def place_order(customer: str, amount_cents: int, remind_after_s: float = 3600, fail: bool = False) -> Order:
    """Create an order and schedule its payment reminder in one transaction.

    ``fail`` raises inside the transaction (as a later step of a real checkout
    could): the order is rolled back, and so is the reminder: it never exists.
    """
    with transaction.atomic():
        order = Order.objects.create(customer=customer, amount_cents=amount_cents)
        h = remind_unpaid.apply_later_on_commit(args=(order.pk,), when=remind_after_s)
        order.reminder_job = h.id if h is not None else ""
        order.save(update_fields=["reminder_job"])
        if fail:
            raise RuntimeError("payment provider refused the card")
    return order
