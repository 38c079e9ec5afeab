"""The admin API (`sandgate run --admin HOST:PORT`): its listener, who may call it, and logins."""
