"""Orders, and the reminder each unpaid one gets."""
