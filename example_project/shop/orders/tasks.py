"""The reminder of an unpaid order: a delayed job, scheduled in the order's own transaction."""

from __future__ import annotations

from shop.celery import app

from celery_delayed import DelayedTask


@app.task(base=DelayedTask, acks_late=True, name="orders.remind_unpaid")
def remind_unpaid(order_id: int) -> str:
    from orders.models import Order

    order = Order.objects.get(pk=order_id)
    return "paid" if order.paid else f"reminded {order.customer}"


@app.task(base=DelayedTask, name="orders.unpaid_digest")
def unpaid_digest() -> int:
    """How many orders are unpaid (a recurring schedule: CELERY_DELAYED_SCHEDULE)."""
    from orders.models import Order

    return Order.objects.filter(paid=False).count()
