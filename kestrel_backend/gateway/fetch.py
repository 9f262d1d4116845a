"""Image links fetched by the gateway (only with --fetch-image-urls), so that a caller cannot make it reach inside.

Each hop's host is resolved first and every address it resolves to must be public: loopback, private, link-local
(cloud metadata, 169.254.169.254), shared, reserved and multicast addresses are refused unless an allowlist names
them (--fetch-allow). The connection goes to the address that was checked (not to a second lookup's), redirects
are followed by hand, each hop checked the same way. One deadline covers the whole fetch, and every failure answers
with the same message: the gateway is not a port scanner.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx

from .errors import ApiError

MAX_REDIRECTS = 3


class Refused(Exception):
    """The link may not be fetched (its address, its scheme, too many redirects)."""


class LinkFetcher:
    def __init__(self, max_bytes: int, timeout_s: float = 10.0, allow: tuple[str, ...] = ()):
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self.allow = tuple(ipaddress.ip_network(a, strict=False) for a in allow)

    async def fetch(self, url: str, name: str) -> bytes:
        try:
            return await asyncio.wait_for(self._follow(url, name), self.timeout_s)
        except ApiError:
            raise
        except (Refused, httpx.HTTPError, httpx.InvalidURL, OSError, TimeoutError, UnicodeError, ValueError):
            raise ApiError(400, f"{name}: the image could not be fetched from its link (links must be public "
                                "http(s) addresses that answer with the image in time)") from None

    def permitted(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        if any(ip in net for net in self.allow):
            return True
        return ip.is_global and not ip.is_multicast

    async def _address(self, host: str, port: int) -> str:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [info[4][0] for info in infos]
        if not addresses or not all(self.permitted(a) for a in addresses):
            raise Refused(host)
        return addresses[0]

    async def _follow(self, url: str, name: str) -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as http:
            target = httpx.URL(url)
            for _ in range(MAX_REDIRECTS + 1):
                if target.scheme not in ("http", "https") or not target.host:
                    raise Refused(url)
                port = target.port or (443 if target.scheme == "https" else 80)
                address = await self._address(target.host, port)
                pinned = target.copy_with(host=address, port=port)
                headers = {"Host": target.netloc.decode("ascii")}
                request = http.build_request("GET", pinned, headers=headers,
                                             extensions={"sni_hostname": target.host})
                response = await http.send(request, stream=True)
                try:
                    if response.is_redirect:
                        target = target.join(response.headers["location"])
                        continue
                    response.raise_for_status()
                    return await self._read(response, name)
                finally:
                    await response.aclose()
            raise Refused(url)

    async def _read(self, response: httpx.Response, name: str) -> bytes:
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > self.max_bytes:
                raise ApiError(413, f"{name}: the image at the link is over the {self.max_bytes} byte limit")
        return bytes(data)
