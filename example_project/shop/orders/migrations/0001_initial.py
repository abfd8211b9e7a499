from __future__ import annotations

from typing import ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[migrations.operations.base.Operation]] = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("customer", models.CharField(max_length=100)),
                ("amount_cents", models.IntegerField()),
                ("paid", models.BooleanField(default=False)),
                ("reminder_job", models.CharField(blank=True, default="", max_length=64)),
            ],
        ),
    ]
