"""The chat page at ``/``: one static HTML file that talks to the gateway's own API.

Why a page at all: a person trying a served model wants to type at it and see how fast it
answers, without writing a client; the page shows time to first token and tokens/s per answer
and lets the user pick tenant and priority class, so the scheduling policies can be watched.
It is shipped as package data and read per request (a few kilobytes), so nothing is read when
the app is built and an installed wheel serves it as the checkout does.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = "static/chat.html"


def page_html() -> str:
    """The page's text, from the installed package."""
    return resources.files(__package__).joinpath(PAGE).read_text(encoding="utf-8")


router = APIRouter()


@router.get("/", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    # NOTE: no-cache, so a browser picks up a new page after an upgrade without a hard reload
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})
