// Live pages: every few seconds, fetch the page again and swap its <main> in
// (the server renders from its latest snapshot; no query per refresh). Pages
// with forms are not live, so nothing typed is lost.
(function () {
  const seconds = Number(document.body.dataset.live || 0);
  if (!seconds) return;
  async function refresh() {
    try {
      const response = await fetch(window.location.href, { credentials: "same-origin" });
      if (response.ok) {
        const page = new DOMParser().parseFromString(await response.text(), "text/html");
        const fresh = page.getElementById("live");
        if (fresh) document.getElementById("live").replaceWith(fresh);
      }
    } catch (error) { /* the next round tries again */ }
    setTimeout(refresh, seconds * 1000);
  }
  setTimeout(refresh, seconds * 1000);
})();
