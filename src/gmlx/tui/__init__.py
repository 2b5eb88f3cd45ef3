"""`gmlx top`: a Textual dashboard that knows the server only through HTTP (`/v1/metrics`, `/system`)."""
