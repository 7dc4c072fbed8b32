// Live pages: every few seconds, fetch the page again and swap its <main> in
// (the server renders from its latest snapshot; no query per refresh). Pages
// with forms are not live, so nothing typed is lost.
(function () {
  const seconds = Number(document.body.dataset.live || 0);
  if (!seconds) return;
  async function refresh() {
    try {
      const response = await fetch(window.location.href, { credentials: "same-origin" });
      const stale = document.getElementById("stale");
      if (response.ok) {
        const page = new DOMParser().parseFromString(await response.text(), "text/html");
        const fresh = page.getElementById("live");
        if (fresh) document.getElementById("live").replaceWith(fresh);
        stale.hidden = true;
      } else {
        stale.hidden = false;  // a queue dropped, a role's rights gone: say so
      }
    } catch (error) {
      document.getElementById("stale").hidden = false;  // the next round tries again
    }
    setTimeout(refresh, seconds * 1000);
  }
  setTimeout(refresh, seconds * 1000);
})();

// The tail page: events as they come, at the top, each value set as text
// (never as markup); the newest 500 kept.
(function () {
  const table = document.getElementById("tail");
  if (!table) return;
  const state = document.getElementById("tail-state");
  const body = table.querySelector("tbody");
  const source = new EventSource(table.dataset.source);
  source.onopen = function () { state.textContent = "Subscribing…"; };
  source.onerror = function () { state.textContent = "Connection lost; retrying."; };
  source.onmessage = function (message) {
    const item = JSON.parse(message.data);
    if (item.state === "following") { state.textContent = "Following."; return; }
    if (item.note !== undefined) {
      const note = document.createElement("li");
      note.textContent = item.note;
      document.getElementById("tail-notes").appendChild(note);
      return;
    }
    const row = document.createElement("tr");
    for (const value of [item.id, item.type, item.key ?? "", item.at, item.data ?? ""]) {
      const cell = document.createElement("td");
      cell.textContent = String(value);
      row.appendChild(cell);
    }
    body.insertBefore(row, body.firstChild);
    while (body.rows.length > 500) body.deleteRow(body.rows.length - 1);
  };
})();
