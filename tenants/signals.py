"""Save/delete signals that mirror policy into Redis after the transaction commits."""
